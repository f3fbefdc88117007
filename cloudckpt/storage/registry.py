"""URI → Store: a small registry of backends keyed by URL scheme."""

from __future__ import annotations

import difflib
import importlib
import os
from collections.abc import Mapping
from typing import Any

from cloudckpt.errors import ConfigError
from cloudckpt.storage.base import Store
from cloudckpt.storage.keys import collapse_slashes
from cloudckpt.storage.options import STORE_OPTIONS, own_options, parse_options

__all__ = ["STORE_OPTIONS", "as_store", "open_store", "parse_options", "register_backend",
           "split_uri"]

# scheme -> "module:Class"; imported lazily so that e.g. gcsfs loads only when used.
_BACKENDS: dict[str, str] = {
    "file": "cloudckpt.storage.file:FileStore",
    "local": "cloudckpt.storage.file:FileStore",
    "memory": "cloudckpt.storage.memory:MemoryStore",
    "s3": "cloudckpt.storage.s3:S3Store",
    "s3a": "cloudckpt.storage.s3:S3Store",
    "gs": "cloudckpt.storage.gcs:GCSStore",
    "gcs": "cloudckpt.storage.gcs:GCSStore",
}


def register_backend(scheme: str, target: str) -> None:
    """Register ``"module:Class"`` (a :class:`Store` subclass) for a URL scheme; the
    class lists ``scheme`` in its ``protocols`` (or lists none: any scheme)."""
    _BACKENDS[scheme] = target


def split_uri(uri: str) -> tuple[str, str]:
    """``"s3://b/p"`` → ``("s3", "b/p")``; a plain path → ``("file", path)``.

    The one normalisation of URIs that every write, listing and delete sees, so
    they all name the same keys: repeated slashes collapse (``s3://b/run//step-1``
    is ``s3://b/run/step-1``), and local paths take fsspec's meaning: ``~`` is the
    home directory, and a relative path (``run``, ``file://rel/run``) is relative
    to the working directory.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigError(f"invalid storage URI {uri!r}: expected e.g. s3://bucket/prefix")
    scheme, sep, rest = uri.partition("://")
    if not sep:
        scheme, rest = "file", uri
    scheme = scheme.lower()
    if scheme in ("file", "local"):
        return "file", os.path.expanduser(collapse_slashes(rest))
    if not rest.strip("/"):
        raise ConfigError(f"invalid storage URI {uri!r}: no bucket or path after {scheme}://")
    return scheme, collapse_slashes(rest).strip("/")


def as_store(uri_or_store: str | Store,
             storage_options: Mapping[str, Any] | None = None) -> Store:
    """``uri_or_store`` itself when it is a :class:`Store`, else :func:`open_store` of it:
    what every API taking "a URI or a store" does first."""
    if isinstance(uri_or_store, Store):
        return uri_or_store
    return open_store(str(uri_or_store), storage_options)


def open_store(uri: str, storage_options: Mapping[str, Any] | None = None) -> Store:
    """Open the store rooted at ``uri``.

    ``storage_options`` go to the fsspec filesystem (``endpoint_url``, ``key``,
    ``secret``, ``token``, ...), except ``retry`` (a :class:`RetryPolicy` or a
    dict of its fields), ``max_concurrency``, ``part_size`` and, for local
    paths, ``fsync``, which configure cloudckpt. Credentials and endpoints not
    given here come from the standard places (``AWS_*`` variables, ``~/.aws``,
    ``STORAGE_EMULATOR_HOST``, application default credentials).

    Every backend is built the same way: ``Backend(root, protocol=scheme,
    storage_options=..., retry=..., max_concurrency=..., part_size=...)``, and
    checks its own storage options.

    Raises :class:`ConfigError` for an unknown URL scheme, an option the backend
    does not know, or a value of the wrong type.
    """
    scheme, root = split_uri(uri)
    options = dict(storage_options or {})
    own = own_options(options)
    cls = _backend(scheme, uri)
    return cls(root, protocol=scheme, storage_options=options, **own)


def _backend(scheme: str, uri: str) -> type[Store]:
    """The Store class for ``scheme``: a registered one, else the generic fsspec one
    where fsspec knows the scheme."""
    target = _BACKENDS.get(scheme)
    if target is None:
        from cloudckpt.storage.fsspec_generic import FsspecStore

        _check_protocol(scheme, uri)
        return FsspecStore
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _check_protocol(scheme: str, uri: str) -> None:
    import fsspec

    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as exc:
        raise ConfigError(f"{uri}: the {scheme}:// filesystem needs a package that is not "
                          f"installed ({exc})") from None
    except ValueError:
        known = sorted(set(_BACKENDS) | {"hdfs", "abfs", "az", "sftp", "http", "https"})
        close = difflib.get_close_matches(scheme, known, n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]}://?" if close else ""
        raise ConfigError(f"unknown URL scheme {scheme}:// in {uri}.{hint} cloudckpt stores "
                          "checkpoints at s3://, gs://, local paths, memory:// and any other "
                          "scheme fsspec knows.") from None

