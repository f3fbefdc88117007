"""Object keys: paths relative to a store's root that can never leave it."""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass

from cloudckpt.errors import ConfigError
from cloudckpt.names import CLAIM_NAME, MANIFEST_NAME


def uri_path(uri: str, scheme: str, path: str) -> str:
    """The path of ``uri`` (its ``scheme``'s, without it) as every backend names it:
    ``a//b///c`` -> ``a/b/c`` (object stores would keep empty components as keys that no
    listing of ``a/b`` shows), and a ``.`` or ``..`` segment refused with
    :class:`ConfigError`: an object store keeps it as a literal key name where a disk
    resolves it, so one URI would name two places. A relative local path may start
    with them (``./run``, ``../runs/x``): that is how it names a place from the working
    directory."""
    path = re.sub("/{2,}", "/", path)
    segments = path.split("/")
    if scheme == "file" and not path.startswith("/"):
        while segments and segments[0] in (".", ".."):
            segments = segments[1:]
    dots = [s for s in segments if s in (".", "..")]
    if dots:
        raise ConfigError(
            f"invalid storage URI {uri!r}: it has a {dots[0]!r} segment, which cloudckpt "
            "refuses on every backend (an object store would keep it as a key name, a disk "
            f"would resolve it: the same URI would name different places). "
            f"{_normalised(scheme, path)}")
    return path


def _normalised(scheme: str, path: str) -> str:
    """What to write instead: the URI with its dot segments resolved, or, where they
    climb above the bucket, one naming the bucket and prefix without them."""
    if scheme == "file":
        return f"Write the normalised path: {posixpath.normpath(path)}"
    bucket, _, key = path.strip("/").partition("/")
    normal = posixpath.normpath(key) if key else "."
    if bucket in (".", "..") or normal.startswith(".."):
        return f"Write the URI without them: {scheme}://BUCKET/PREFIX"
    return f"Write the normalised URI: {scheme}://{bucket}" + (
        "" if normal == "." else f"/{normal}")


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


#: What a :meth:`~cloudckpt.storage.Store.writing_under` view keeps at its own name:
#: the objects the commit protocol finds by name.
FIXED_NAMES = (MANIFEST_NAME, CLAIM_NAME)


@dataclass(frozen=True)
class KeyMap:
    """Where a store's keys lie below its root: at their own paths (:data:`PLAIN`), read
    from other objects of the backend (``located``: key -> path below the backend's
    root; such a view is read-only), or written in an area below the root its view was
    made at (``under``: that root, and the area)."""

    located: Mapping[str, str] | None = None
    under: tuple[str, str] | None = None

    def path(self, root: str, key: str) -> str:
        """The backend path of ``key`` of a store rooted at ``root``."""
        if self.located is not None:
            located = self.located.get(key)
            if located is not None:
                return located
        if self.under is not None and key.rsplit("/", 1)[-1] not in FIXED_NAMES:
            anchor, area = self.under
            return f"{anchor}/{area}/{self.plain(root, key)[len(anchor) + 1:]}"
        return self.plain(root, key)

    @staticmethod
    def plain(root: str, key: str) -> str:
        """``key``'s own path below ``root``, whatever the view."""
        return f"{root}/{validate_key(key)}"

    def child(self, prefix: str) -> KeyMap:
        """The map of a child store at ``prefix``: the located keys below it, relative
        to it; the same area."""
        if self.located is None:
            return self
        below = prefix + "/"
        return KeyMap({k[len(below):]: v for k, v in self.located.items()
                       if k.startswith(below)}, self.under)


#: The key map of a plain store: every key at its own path.
PLAIN = KeyMap()
