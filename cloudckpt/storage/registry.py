"""URI → Store: backends found by URL scheme.

A scheme's backend is, in this order: one given to :func:`register_backend`, a
built-in one (below), one a package declares as an entry point in the group
``cloudckpt.backends`` (name: the scheme; value: ``"module:Class"``), or else
the generic fsspec backend where fsspec knows the scheme. Targets are imported
on first use, so that e.g. gcsfs loads only when a ``gs://`` URI is opened.

A target is a backend class (:mod:`.backend`), held by a :class:`Store`.
"""

from __future__ import annotations

import difflib
import os
import posixpath
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, TypeGuard

from cloudckpt.errors import ConfigError
from cloudckpt.storage import retry
from cloudckpt.storage.keys import uri_path
from cloudckpt.storage.options import STORE_OPTIONS, own_options, parse_options
from cloudckpt.storage.store import Store
from cloudckpt.util.lazy import load_target

__all__ = ["ENTRY_POINT_GROUP", "STORE_OPTIONS", "as_store", "can_open", "open_below",
           "open_store", "parse_options", "register_backend", "schemes_like", "split_uri"]

#: The entry-point group third-party backends are declared in.
ENTRY_POINT_GROUP = "cloudckpt.backends"

@dataclass(frozen=True)
class Builtin:
    """A built-in backend: the URL schemes it serves, its class (``"module:Class"``,
    imported on first use) and, where its failures can be told apart without its
    client library, the function that classifies them (``"module:function"``)."""

    schemes: tuple[str, ...]
    backend: str
    errors: str | None = None


#: The built-in backends; adding one is one entry here (and its package under
#: ``backends/``).
BUILTIN = (
    Builtin(("file", "local"), "cloudckpt.storage.backends.file:FileBackend"),
    Builtin(("memory",), "cloudckpt.storage.backends.memory:MemoryBackend"),
    Builtin(("s3", "s3a"), "cloudckpt.storage.backends.s3:S3Backend",
            "cloudckpt.storage.backends.s3.errors:classify"),
    Builtin(("gs", "gcs"), "cloudckpt.storage.backends.gcs:GCSBackend",
            "cloudckpt.storage.backends.gcs.errors:classify"),
    Builtin(("az", "abfs", "abfss"), "cloudckpt.storage.backends.azure:AzureBackend",
            "cloudckpt.storage.backends.azure.errors:classify"),
)

# scheme -> "module:Class": the built-in backends, and those registered since.
_BACKENDS: dict[str, str] = {s: b.backend for b in BUILTIN for s in b.schemes}

# A failure whose backend is not named (cloudckpt.storage.is_transient(exc), the
# description of an error from anywhere) is judged by the built-in backends' rules;
# those modules import no client library.
for _builtin in BUILTIN:
    if _builtin.errors is not None:
        retry.add_fallback(load_target(_builtin.errors))

_entry_points: dict[str, str] | None = None
_entry_lock = threading.Lock()


def register_backend(scheme: str, target: str) -> None:
    """Register ``"module:Class"`` for a URL scheme: a backend class (see
    :mod:`cloudckpt.storage.backend`) that lists ``scheme`` in its ``protocols``
    (or lists none: any scheme). Replaces
    a built-in or entry-point backend of that scheme."""
    _BACKENDS[scheme] = target


def _declared() -> dict[str, str]:
    """scheme -> "module:Class" of the entry points in :data:`ENTRY_POINT_GROUP` of
    every installed distribution (read once per process)."""
    global _entry_points
    with _entry_lock:
        if _entry_points is None:
            _entry_points = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
        return _entry_points


def schemes_like(scheme: str) -> tuple[str, ...]:
    """Every URL scheme the backend of ``scheme`` serves, ``scheme`` first
    (``"s3"`` -> ``("s3", "s3a")``); for code that accepts one kind of store."""
    table = {**_declared(), **_BACKENDS}
    target = table.get(scheme)
    return (scheme, *(s for s, t in table.items() if t == target and s != scheme))


def split_uri(uri: str) -> tuple[str, str]:
    """``"s3://b/p"`` → ``("s3", "b/p")``; a plain path → ``("file", path)``.

    The one normalisation of URIs that every write, listing and delete sees, so
    they all name the same keys: repeated slashes collapse (``s3://b/run//step-1``
    is ``s3://b/run/step-1``), a ``.`` or ``..`` segment is refused on every backend
    (:func:`~cloudckpt.storage.keys.uri_path`), and local paths take fsspec's meaning:
    ``~`` is the home directory, and a relative path (``run``, ``file://rel/run``,
    ``../runs/x``) is relative to the working directory.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigError(f"invalid storage URI {uri!r}: expected e.g. s3://bucket/prefix")
    scheme, sep, rest = uri.partition("://")
    if not sep:
        scheme, rest = "file", uri
    scheme = scheme.lower()
    if scheme in ("file", "local"):
        return "file", uri_path(uri, "file", os.path.expanduser(rest))
    if not rest.strip("/"):
        raise ConfigError(f"invalid storage URI {uri!r}: no bucket or path after {scheme}://")
    return scheme, uri_path(uri, scheme, rest).strip("/")


def can_open(uri: object) -> bool:
    """Whether :func:`open_store` opens ``uri`` (a string or path-like): a local path, or
    a URL whose scheme has a backend (registered, built-in, declared by a package, or
    a filesystem fsspec knows and can import). What DCP asks a storage class of an id."""
    try:
        scheme, _ = split_uri(uri if isinstance(uri, str) else os.fspath(uri))  # type: ignore[call-overload]
        if scheme not in _BACKENDS and scheme not in _declared():
            _check_protocol(scheme, str(uri))
    except (ConfigError, TypeError):
        return False
    return True


def is_remote(uri: object) -> TypeGuard[str]:
    """Whether ``uri`` is a string naming an object store rather than a local path
    (``s3://b/p`` yes; ``/data/run``, ``file:///data/run``, ``run``, a ``Path``, None
    no): what a framework's config value says about where it saves."""
    return isinstance(uri, str) and split_uri(uri)[0] != "file"


def as_store(uri_or_store: str | Store,
             storage_options: Mapping[str, Any] | None = None) -> Store:
    """``uri_or_store`` itself when it is a :class:`Store`, else :func:`open_store` of it:
    what every API taking "a URI or a store" does first."""
    if isinstance(uri_or_store, Store):
        return uri_or_store
    return open_store(str(uri_or_store), storage_options)


def open_below(base: Store, uri: str, storage_options: Mapping[str, Any] | None = None
               ) -> Store:
    """The store ``uri`` names for something rooted at ``base`` (a run's manager): a
    relative ``uri`` (no scheme, not absolute, no ``~``: ``step-100``) is a prefix below
    ``base``, not below the working directory; any other is opened as
    :func:`open_store` opens it, with ``storage_options``.

    Raises :class:`ConfigError` for a relative ``uri`` leading out of ``base``.
    """
    uri = os.fspath(uri)
    if "://" in uri or os.path.isabs(uri) or uri.startswith("~"):
        return open_store(uri, storage_options)
    rel = posixpath.normpath(uri)
    if rel == ".." or rel.startswith("../"):
        raise ConfigError(f"{uri!r} leads out of {base.uri}: a relative URI names a prefix "
                          "below the root; pass an absolute path or a URL for one elsewhere")
    return base.child("" if rel == "." else rel)


def open_store(uri: str, storage_options: Mapping[str, Any] | None = None) -> Store:
    """Open the store rooted at ``uri``.

    ``storage_options`` go to the fsspec filesystem (``endpoint_url``, ``key``,
    ``secret``, ``token``, ...), except ``retry`` (a :class:`RetryPolicy` or a
    dict of its fields), ``max_concurrency``, ``part_size`` and, for local
    paths, ``fsync``, which configure cloudckpt. Credentials and endpoints not
    given here come from the standard places (``AWS_*`` variables, ``~/.aws``,
    ``STORAGE_EMULATOR_HOST``, application default credentials).

    Every store is built the same way: ``Store(root, Backend, protocol=scheme,
    storage_options=..., retry=..., max_concurrency=..., part_size=...)``, and its
    backend checks its own storage options.

    Raises :class:`ConfigError` for an unknown URL scheme, an option the backend
    does not know, or a value of the wrong type.
    """
    scheme, root = split_uri(uri)
    options = dict(storage_options or {})
    own = own_options(options)
    return Store(root, _backend(scheme, uri), protocol=scheme, storage_options=options, **own)


def _backend(scheme: str, uri: str) -> Any:
    """The backend class for ``scheme``: a registered or built-in
    one, one an entry point declares, else the generic fsspec one where fsspec knows
    the scheme."""
    target = _BACKENDS.get(scheme) or _declared().get(scheme)
    if target is None:
        from cloudckpt.storage.backends.fsspec_generic import FsspecGenericBackend

        _check_protocol(scheme, uri)
        return FsspecGenericBackend
    try:
        return load_target(target)
    except ImportError as exc:
        raise ConfigError(f"{uri}: {exc}") from exc


def _check_protocol(scheme: str, uri: str) -> None:
    import fsspec

    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as exc:
        raise ConfigError(f"{uri}: the {scheme}:// filesystem needs a package that is not "
                          f"installed ({exc})") from None
    except ValueError:
        known = sorted(set(_BACKENDS) | set(_declared())
                       | {"hdfs", "abfs", "az", "sftp", "http", "https"})
        close = difflib.get_close_matches(scheme, known, n=1, cutoff=0.5)
        hint = f" Did you mean {close[0]}://?" if close else ""
        raise ConfigError(f"unknown URL scheme {scheme}:// in {uri}.{hint} cloudckpt stores "
                          "checkpoints at s3://, gs://, az://, local paths, memory:// and any "
                          "other scheme fsspec knows.") from None

