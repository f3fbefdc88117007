"""gcsfs's private internals: its request call, session, parameters and headers, its
batch delete, and its request without the retries.

cloudckpt sends GCS requests gcsfs has no public call for (multipart uploads with a
precondition and a CRC32C, compose, rewrite, ranged GETs read as they arrive) through
gcsfs's own session, so they carry its credentials, endpoint and error translation.

cloudckpt's client is gcsfs's core class (``gcsfs.core.GCSFileSystem``), whatever
``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` makes ``gcsfs.GCSFileSystem`` in the host process
(gcsfs reads it once, at its import, and by default swaps in its experimental
subclass, whose every call to an emulator stalls about a minute): a library leaves its
host's environment, and the host's other users of gcsfs, as they are.
"""

from __future__ import annotations

from typing import Any

import gcsfs.core

from cloudckpt.compat import Internal

_FS = "gcsfs.core.GCSFileSystem"

INTERNALS = {
    f"{_FS}._call": Internal("one JSON API request through gcsfs's session and errors"),
    f"{_FS}._location": Internal("the endpoint gcsfs sends to (an emulator's, or Google's)"),
    f"{_FS}._delete_files": Internal(
        "a batch delete of literal names: gcsfs's rm() expands glob characters"),
    f"{_FS}._set_session": Internal("gcsfs's aiohttp session, made on first use"),
    f"{_FS}._get_params": Internal("the query parameters gcsfs adds (user project)"),
    f"{_FS}._get_headers": Internal("the headers gcsfs adds: its credentials' token"),
    f"{_FS}._request": Internal("overridden by OneTryGCSFileSystem"),
    f"{_FS}._request.__wrapped__": Internal(
        "gcsfs's request without its retry decorator (six tries, sleeps up to 16 s): "
        "retries are cloudckpt's, under its deadline"),
}


class OneTryGCSFileSystem(gcsfs.core.GCSFileSystem):
    """gcsfs with one try per request (``GCSFileSystem._request`` unwrapped from its
    retry decorator): retries belong to cloudckpt's RetryPolicy."""

    _request = getattr(gcsfs.core.GCSFileSystem._request, "__wrapped__",
                       gcsfs.core.GCSFileSystem._request)


async def call(fs: gcsfs.core.GCSFileSystem, method: str, path: str, *args: Any,
               **kwargs: Any) -> Any:
    """``GCSFileSystem._call``: one request of the JSON API (``path`` a template of
    ``args``, relative to the API's base unless a URL), gcsfs's errors as OSErrors."""
    return await fs._call(method, path, *args, **kwargs)


def location(fs: gcsfs.core.GCSFileSystem) -> str:
    """``GCSFileSystem._location``: the endpoint's base URL."""
    return str(fs._location)


async def delete_files(fs: gcsfs.core.GCSFileSystem, paths: list[str], batch: int) -> list[Any]:
    """``GCSFileSystem._delete_files``: deletes ``paths`` literally, ``batch`` per request;
    a result per path (None, or its exception)."""
    return await fs._delete_files(paths, batch)


async def session(fs: gcsfs.core.GCSFileSystem) -> Any:
    """``GCSFileSystem._set_session``: gcsfs's aiohttp session, made if need be."""
    return await fs._set_session()


def params(fs: gcsfs.core.GCSFileSystem) -> dict[str, Any]:
    """``GCSFileSystem._get_params``: the query parameters gcsfs sends with a request."""
    return fs._get_params({})


def headers(fs: gcsfs.core.GCSFileSystem, extra: dict[str, str] | None = None) -> dict[str, str]:
    """``GCSFileSystem._get_headers``: gcsfs's headers (its credentials) plus ``extra``."""
    return fs._get_headers(dict(extra or {}))
