"""Run Python scripts and the ``shardkit`` command in processes that skip Python's and torch's start-up.

``WarmPython()`` starts one interpreter that imports torch, ``shardkit.checkpoint`` and ``shardkit.cli``
once (seconds on a small machine), then forks a fresh child for each ``run(...)``: the child changes into
``cwd``, sets ``env``, sends its output to files and runs, as ``__main__`` with ``sys.argv`` set, either a
script (as ``python script.py`` does, its folder first on ``sys.path``) or the ``shardkit`` console
command's entry point (``shardkit.cli.main``, as the installed ``shardkit`` script calls it). It then ends
as an interpreter does (non-daemon threads joined, ``atexit`` handlers run, output flushed) and exits with
the code ``python`` would give: 0, a ``SystemExit``'s code, or 1 and the traceback on stderr.

It is not a sandbox: each run is its own process, but every child starts from the same imported modules.
It is for tests that run many short scripts (``tests/test_readme.py``). Example::

    with WarmPython() as py:
        code, out, err = py.run(["block.py"], cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile

_SERVER = r'''
import atexit, json, os, runpy, sys, threading, traceback
import torch, shardkit.checkpoint, shardkit.cli            # the start-up every child shares


def _exit_code(e):
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


def _child(req):
    os.chdir(req["cwd"])
    os.environ.update(req["env"])
    for fd, path in ((1, req["out"]), (2, req["err"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.argv = list(req["argv"])
    code = 0
    try:
        if req["kind"] == "script":
            sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
            runpy.run_path(sys.argv[0], run_name="__main__")
        else:
            code = shardkit.cli.main() or 0
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        threading._shutdown()                                # what the interpreter does at exit, in its order
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    os._exit(code)


for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        _child(request)
    print(json.dumps(pid), flush=True)                        # so that a hung child can be killed
    print(json.dumps(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])), flush=True)
'''


class WarmPython:
    """One warm interpreter; each :meth:`run` is a child forked from it (see the module's docstring)."""

    def __init__(self, env: dict | None = None):
        self._tmp = tempfile.TemporaryDirectory(prefix="warm-python-")
        self._proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self._runs = 0

    def run(self, argv: list[str], cwd, env: dict, *, command: bool = False,
            timeout_s: float = 240) -> tuple[int, str, str]:
        """``(exit code, stdout, stderr)`` of ``argv`` run in a fresh child: a script, or with ``command``
        the ``shardkit`` console command (``argv[0]`` is then its name). A hang past ``timeout_s`` fails."""
        self._runs += 1
        out, err = (os.path.join(self._tmp.name, f"{self._runs}.{n}") for n in ("out", "err"))
        request = {"cwd": str(cwd), "env": env, "argv": [str(a) for a in argv], "out": out, "err": err,
                   "kind": "command" if command else "script"}
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        pid = self._reply(argv, timeout_s)
        try:
            code = self._reply(argv, timeout_s)
        except AssertionError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self.close()
            raise
        with open(out, encoding="utf-8", errors="replace") as f_out, open(err, encoding="utf-8",
                                                                          errors="replace") as f_err:
            return code, f_out.read(), f_err.read()

    def _reply(self, argv, timeout_s: float) -> int:
        if not select.select([self._proc.stdout], [], [], timeout_s)[0]:
            raise AssertionError(f"{argv} did not finish within {timeout_s} s (a hang guard, not a timing)")
        line = self._proc.stdout.readline()
        if not line:
            raise AssertionError(f"the warm interpreter ended while running {argv} (exit {self._proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()                         # the server's loop ends between runs
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._tmp.cleanup()

    def __enter__(self) -> "WarmPython":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
