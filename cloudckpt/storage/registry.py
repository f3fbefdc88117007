"""URI → Store: a small registry of backends keyed by URL scheme."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError
from .base import Store
from .retry import RetryPolicy

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

#: storage_options keys that configure cloudckpt itself rather than the filesystem.
STORE_OPTIONS = ("retry", "max_concurrency", "part_size")


def register_backend(scheme: str, target: str) -> None:
    """Register ``"module:Class"`` (a :class:`Store` subclass) for a URL scheme."""
    _BACKENDS[scheme] = target


def split_uri(uri: str) -> tuple[str, str]:
    """``"s3://b/p"`` → ``("s3", "b/p")``; a plain path → ``("file", path)``."""
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigError(f"invalid storage URI {uri!r}: expected e.g. s3://bucket/prefix")
    if "://" not in uri:
        return "file", uri
    scheme, rest = uri.split("://", 1)
    scheme = scheme.lower()
    if scheme in ("file", "local"):
        return "file", rest if rest.startswith("/") else "/" + rest
    if not rest.strip("/"):
        raise ConfigError(f"invalid storage URI {uri!r}: no bucket or path after {scheme}://")
    return scheme, rest.strip("/")


def open_store(uri: str, storage_options: Mapping[str, Any] | None = None) -> Store:
    """Open the store rooted at ``uri``.

    ``storage_options`` go to the fsspec filesystem (``endpoint_url``, ``key``,
    ``secret``, ``token``, ...), except ``retry`` (a :class:`RetryPolicy` or a
    dict of its fields), ``max_concurrency``, ``part_size`` and, for local
    paths, ``fsync``, which configure cloudckpt. Credentials and endpoints not
    given here come from the standard places (``AWS_*`` variables, ``~/.aws``,
    ``STORAGE_EMULATOR_HOST``, application default credentials).
    """
    scheme, root = split_uri(uri)
    options = dict(storage_options or {})
    own: dict[str, Any] = {k: options.pop(k) for k in STORE_OPTIONS if k in options}
    retry = own.get("retry")
    if isinstance(retry, Mapping):
        try:
            own["retry"] = RetryPolicy(**retry)
        except TypeError as exc:
            raise ConfigError(f"invalid retry options {dict(retry)!r}: {exc}") from None
    elif retry is not None and not isinstance(retry, RetryPolicy):
        raise ConfigError("storage_options['retry'] must be a RetryPolicy or a dict")
    target = _BACKENDS.get(scheme)
    if target is None:
        from .fsspec_generic import FsspecStore

        return FsspecStore(scheme, root, storage_options=options, **own)
    module, _, name = target.partition(":")
    cls: type[Store] = getattr(importlib.import_module(module), name)
    if scheme in ("file", "local", "memory"):
        if scheme == "file" and "fsync" in options:
            own["fsync"] = bool(options.pop("fsync"))
        if options:
            raise ConfigError(
                f"unknown storage options for {scheme}:// : {sorted(options)}; "
                f"allowed: {sorted(STORE_OPTIONS) + (['fsync'] if scheme == 'file' else [])}"
            )
        return cls(root, **own)
    return cls(root, storage_options=options, **own)
