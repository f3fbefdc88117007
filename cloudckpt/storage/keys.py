"""Object keys: paths relative to a store's root that can never leave it."""

from __future__ import annotations

import re

from cloudckpt.errors import ConfigError


def collapse_slashes(path: str) -> str:
    """``a//b///c`` -> ``a/b/c``, as every URI is normalised (``split_uri``): object
    stores would keep empty components as keys that no listing of ``a/b`` shows."""
    return re.sub("/{2,}", "/", path)


def validate_key(key: str) -> str:
    """Refuse keys that could leave the store's root or are not plain relative paths."""
    if not isinstance(key, str) or not key:
        raise ConfigError(f"invalid object key {key!r}: must be a non-empty string")
    if "://" in key or key.startswith("/") or "\\" in key or "\x00" in key:
        raise ConfigError(f"invalid object key {key!r}: must be a relative POSIX path")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ConfigError(f"invalid object key {key!r}: empty, '.' or '..' path component")
    return key
