"""Which checkpoint name fills which state leaf: ``load``'s name options, planned as plain data.

:func:`plan_names` maps the leaves of a state (tensors and plain values, by
dotted name) to the names a checkpoint holds, under :class:`LoadOptions`:

- ``prefix``: state name ``N`` is read from checkpoint name ``prefix + N``;
  checkpoint names without the prefix are outside the load (never
  "unexpected"). ``prefix="model."`` loads the ``model`` part of a training
  checkpoint (``{"model": ..., "optim": ...}``) into a bare
  ``model.state_dict()``, or a Hugging Face ``*ForCausalLM`` checkpoint
  (``model.layers.0...``) into its base model (``layers.0...``);
- ``rename(checkpoint_name) -> state_name | None``: any other mapping (None:
  skip that checkpoint name), applied after ``prefix`` strips its part;
  e.g. ``rename=lambda n: "module." + n`` for a DDP-wrapped state;
- ``exclude``: glob patterns (``fnmatch``, ``*`` crosses dots) on state
  names; a matching leaf is neither read nor required, a matching
  checkpoint name is ignored;
- ``strict`` (checkpoint names the state lacks are an error) and
  ``allow_partial`` (state leaves the checkpoint lacks are left untouched
  instead of an error);
- ``aliases`` (``{checkpoint name: stored name}``, tied weights a Hugging
  Face checkpoint stores once): a state leaf mapped from an alias reads the
  stored tensor.

Pure: no tensors, no I/O; mismatches raise :class:`TensorMismatchError`
saying what was found and which option fixes it.

Example::

    plan = plan_names(["w", "lm_head.weight"], [], {"model.w", "model.lm_head.weight"}, set(),
                      LoadOptions(prefix="model."))
    plan.tensors       # {"w": "model.w", "lm_head.weight": "model.lm_head.weight"}
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Callable, Collection, Mapping

from shardkit.errors import TensorMismatchError

__all__ = ["LoadOptions", "NamePlan", "plan_names"]


@dataclass(frozen=True)
class LoadOptions:
    """``load``'s options about names and dtypes (see the module docstring and ``checkpoint.load``)."""

    strict: bool = True
    cast: bool = False
    prefix: str | None = None
    rename: Callable[[str], str | None] | None = None
    allow_partial: bool = False
    exclude: tuple[str, ...] = ()

    def __post_init__(self):
        if self.prefix is not None and not isinstance(self.prefix, str):
            raise TypeError(f"prefix must be a str (e.g. 'model.'), got {type(self.prefix).__name__}")
        if self.rename is not None and not callable(self.rename):
            raise TypeError(f"rename must be a callable checkpoint_name -> state_name or None, got "
                            f"{type(self.rename).__name__}")
        exclude = (self.exclude,) if isinstance(self.exclude, str) else tuple(self.exclude)
        if not all(isinstance(p, str) for p in exclude):
            raise TypeError(f"exclude must be glob patterns (str), got {exclude!r}")
        object.__setattr__(self, "exclude", exclude)

    def state_name(self, checkpoint_name: str) -> str | None:
        """The state name ``checkpoint_name`` fills, or None when it is outside the load."""
        name = checkpoint_name
        if self.prefix:
            if not name.startswith(self.prefix):
                return None
            name = name[len(self.prefix):]
        if self.rename is not None:
            name = self.rename(name)
            if name is not None and not isinstance(name, str):
                raise TypeError(f"rename({checkpoint_name!r}) returned {name!r}; it must return a str or None")
        return name

    def excluded(self, state_name: str) -> bool:
        return any(fnmatch.fnmatchcase(state_name, p) for p in self.exclude)


@dataclass
class NamePlan:
    """``tensors`` / ``objects``: ``{state name: checkpoint name}`` to fill; ``untouched``: state leaves left as
    they are (excluded, or absent from the checkpoint with ``allow_partial``)."""

    tensors: dict[str, str] = field(default_factory=dict)
    objects: dict[str, str] = field(default_factory=dict)
    untouched: list[str] = field(default_factory=list)


def plan_names(state_tensors: Collection[str], state_others: Collection[str], saved_tensors: Collection[str],
               saved_objects: Collection[str], options: LoadOptions,
               aliases: Mapping[str, str] | None = None) -> NamePlan:
    """Map every state leaf to the checkpoint name it is read from (see the module docstring)."""
    saved_tensors, saved_objects, aliases = set(saved_tensors), set(saved_objects), dict(aliases or {})
    to_checkpoint = _state_to_checkpoint(saved_tensors | saved_objects, aliases, options)
    ordered = [*state_tensors, *state_others]
    state_tensors = set(state_tensors)
    plan = NamePlan()
    missing = []
    for name in ordered:
        source = to_checkpoint.get(name)
        if options.excluded(name):
            plan.untouched.append(name)
        elif source is None:
            missing.append(name)
        elif name in state_tensors:
            plan.tensors[name] = _tensor_source(name, source, saved_tensors, aliases)
        elif source in saved_tensors:
            raise TensorMismatchError(f"state_dict's leaf {name!r} is not a tensor, but the checkpoint holds a "
                                      f"tensor there ({source!r}); put a tensor there, or exclude= it")
        else:
            plan.objects[name] = source
    _refuse_missing(missing, to_checkpoint, options, plan)
    _refuse_unexpected(to_checkpoint, set(ordered), aliases, options)
    return plan


def _state_to_checkpoint(names: set[str], aliases: Mapping[str, str], options: LoadOptions) -> dict[str, str]:
    """``{state name: checkpoint name}`` for every checkpoint name inside the load; a stored name wins over
    an alias, and two stored names mapped to one state name are refused."""
    out: dict[str, str] = {}
    for name in sorted(names):
        state = options.state_name(name)
        if state is None:
            continue
        if state in out:
            raise TensorMismatchError(f"checkpoint names {out[state]!r} and {name!r} both map to the state name "
                                      f"{state!r} (prefix={options.prefix!r}, rename); make the mapping one-to-one")
        out[state] = name
    for alias in sorted(set(aliases) - names):
        state = options.state_name(alias)
        if state is not None and state not in out:
            out[state] = alias
    return out


def _tensor_source(name: str, source: str, saved_tensors: set[str], aliases: Mapping[str, str]) -> str:
    stored = source if source in saved_tensors else aliases.get(source)
    if stored is None or stored not in saved_tensors:
        raise TensorMismatchError(f"state_dict has a tensor {name!r}, but the checkpoint holds a plain value "
                                  f"there ({source!r}); put a plain value there, or exclude= it")
    return stored


def _refuse_missing(missing: list[str], to_checkpoint: Mapping[str, str], options: LoadOptions,
                    plan: NamePlan) -> None:
    if options.allow_partial or not missing:
        plan.untouched.extend(missing)
        return
    held = sorted(to_checkpoint)
    raise TensorMismatchError(
        f"state_dict has {len(missing)} leaves the checkpoint lacks: {_sample(missing)}; the checkpoint holds "
        f"{_sample(held) or 'nothing'}{_mapping(options)}. Pass allow_partial=True to leave them as they are, "
        f"exclude= to skip them, or prefix=/rename= to map the checkpoint's names to the state's")


def _refuse_unexpected(to_checkpoint: Mapping[str, str], state_names: set[str], aliases: Mapping[str, str],
                       options: LoadOptions) -> None:
    if not options.strict:
        return
    unexpected = sorted(s for s, c in to_checkpoint.items()
                        if s not in state_names and c not in aliases and not options.excluded(s))
    if unexpected:
        raise TensorMismatchError(
            f"the checkpoint holds {len(unexpected)} leaves state_dict lacks: {_sample(unexpected)}"
            f"{_mapping(options)}; pass a state_dict with them (an optimizer's state: use get_state_dict, which "
            f"creates it), strict=False to ignore them, or exclude= to skip them")


def _mapping(options: LoadOptions) -> str:
    parts = [f"prefix={options.prefix!r}" if options.prefix else "", "rename" if options.rename else ""]
    parts = [p for p in parts if p]
    return f" (as named under {', '.join(parts)})" if parts else ""


def _sample(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
