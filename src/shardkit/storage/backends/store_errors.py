"""Where an object-store client's failure gets its shardkit type: :func:`store_errors`.

s3fs, botocore and aiohttp raise their own exceptions (``EndpointConnectionError``,
``ClientError``, ``ClientPayloadError``) or plain ``OSError`` / ``PermissionError``
ones. Around every call ``FsspecStorage`` (and its readers and S3 uploads) makes,
they become a :class:`~shardkit.errors.CheckpointIOError` (an ``OSError``, as a
local ``EACCES`` or ``ENOSPC`` does) naming the URL and the operation, the
original chained. A malformed bucket name (botocore's ``ParamValidationError``)
becomes a :class:`~shardkit.errors.MetadataError`.

Not translated: shardkit's own errors, and ``FileNotFoundError`` (a missing object
keeps meaning "not there": ``MissingShardError`` where the callers map it today).
botocore and aiohttp are looked up only when a failure is seen, and only if some
code already imported them: shardkit imports without s3fs.

Example::

    with store_errors("s3://bucket/ck/metadata.json", "read"):
        fs.cat_file("bucket/ck/metadata.json")
"""

from __future__ import annotations

import contextlib
import errno as errno_codes
import functools
import sys
from typing import Iterator

from shardkit.errors import CheckpointIOError, MetadataError, ShardkitError

__all__ = ["store_errors", "translated", "client_error", "READ_OUTCOME"]

READ_OUTCOME = "Nothing was changed."

_REACH_FIX = ("Check the endpoint (AWS_ENDPOINT_URL, or fsspec's configuration), the network and that the "
              "server is up, then try again")
_DENIED_FIX = ("Use credentials allowed to do this (AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY), or "
               "grant these ones access in the bucket's policy, then try again")
_CREDENTIALS_FIX = "Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), then try again"
_OTHER_FIX = "Check the URL and the store's health, then try again"


def _client_classes() -> tuple[type, ...]:
    """The client libraries' base exception classes that are loaded (none imported here)."""
    found = []
    botocore = sys.modules.get("botocore.exceptions")
    if botocore is not None:
        found += [botocore.BotoCoreError, botocore.ClientError]
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None:
        found.append(aiohttp.ClientError)
    return tuple(found)


def _is_bad_parameter(e: BaseException) -> bool:
    botocore = sys.modules.get("botocore.exceptions")
    return botocore is not None and isinstance(e, botocore.ParamValidationError)


def _errno_of(e: BaseException) -> int | None:
    """The first ``errno`` in ``e`` or the exceptions it was raised from (a refused connection's ``ECONNREFUSED``)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and isinstance(e.errno, int):
            return e.errno
        e = e.__cause__ or e.__context__
    return None


def _diagnosis(e: BaseException, code: int | None) -> tuple[str, str]:
    """(what happened, what to do) for a client failure ``e``."""
    names = {c.__name__ for c in type(e).__mro__}
    response = getattr(e, "response", None)
    server_code = str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""
    if isinstance(e, PermissionError) or code in (errno_codes.EACCES, errno_codes.EPERM) or server_code in (
            "AccessDenied", "403", "AllAccessDisabled", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return "the object store refused permission", _DENIED_FIX
    if any("Credentials" in n for n in names):
        return "no usable credentials were found", _CREDENTIALS_FIX
    if isinstance(e, TimeoutError) or names & {"ReadTimeoutError", "ServerTimeoutError", "ClientPayloadError"}:
        return "the transfer broke off or timed out", _REACH_FIX
    if isinstance(e, ConnectionError) or names & {"ConnectionError", "ClientConnectionError"}:
        return "the object store could not be reached", _REACH_FIX
    return "the object store failed the request", _OTHER_FIX


def client_error(e: BaseException, url: str, doing: str, outcome: str = READ_OUTCOME) -> BaseException | None:
    """The shardkit error for ``e`` hit while ``doing`` ``url``; None where ``e`` keeps its own type
    (shardkit's errors, ``FileNotFoundError``, anything not from the store's client or an ``OSError``)."""
    if isinstance(e, (ShardkitError, FileNotFoundError)):
        return None
    if _is_bad_parameter(e):
        return MetadataError(f"{url} is not a valid object-store location ({type(e).__name__}: {e}). Fix the "
                             f"bucket name in the URL (S3: 3-63 lowercase letters, digits, '.' and '-').")
    if not isinstance(e, (OSError, *_client_classes())):
        return None
    code = _errno_of(e)
    if code is None and isinstance(e, PermissionError):
        code = errno_codes.EACCES
    what, fix = _diagnosis(e, code)
    return CheckpointIOError(f"could not {doing} {url}: {what} ({type(e).__name__}: {e}). {outcome} {fix}.",
                             code, getattr(e, "strerror", None) or str(e), url)


@contextlib.contextmanager
def store_errors(url: str, doing: str, outcome: str = READ_OUTCOME) -> Iterator[None]:
    """Raise :func:`client_error`'s typed error (chained) for a client failure in the block; others pass."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 -- only the client's failures are replaced; the rest re-raised as they are
        typed = client_error(e, url, doing, outcome)
        if typed is None:
            raise
        raise typed from e


def translated(doing: str, outcome: str = READ_OUTCOME):
    """Decorate a storage method whose first argument is a URL: :func:`store_errors` around its call."""
    def wrap(method):
        @functools.wraps(method)
        def call(self, path, *args, **kwargs):
            with store_errors(path if isinstance(path, str) else f"{len(path)} objects", doing, outcome):
                return method(self, path, *args, **kwargs)
        return call
    return wrap
