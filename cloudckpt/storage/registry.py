"""URI → Store: a small registry of backends keyed by URL scheme."""

from __future__ import annotations

import difflib
import importlib
import json
from collections.abc import Mapping, Sequence
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

    Raises :class:`ConfigError` for an unknown URL scheme, an option the backend
    does not know, or a value of the wrong type.
    """
    scheme, root = split_uri(uri)
    options = dict(storage_options or {})
    own = _own_options(options)
    target = _BACKENDS.get(scheme)
    if target is None:
        from .fsspec_generic import FsspecStore

        _check_protocol(scheme, uri)
        return FsspecStore(scheme, root, storage_options=options, **own)
    module, _, name = target.partition(":")
    cls: type[Store] = getattr(importlib.import_module(module), name)
    if scheme in ("file", "local", "memory"):
        if scheme == "file" and "fsync" in options:
            own["fsync"] = _flag("fsync", options.pop("fsync"))
        if options:
            raise ConfigError(
                f"unknown storage options for {scheme}:// : {sorted(options)}; "
                f"allowed: {sorted(STORE_OPTIONS) + (['fsync'] if scheme == 'file' else [])}"
            )
        return cls(root, **own)
    _check_names(scheme, options, cls.filesystem_options())
    _check_types(options)
    return cls(root, storage_options=options, **own)


#: Filesystem options that must be mappings, and those that are switches.
_MAPPINGS = ("client_kwargs", "config_kwargs", "s3_additional_kwargs", "session_kwargs")
_FLAGS = ("anon", "use_ssl", "requester_pays", "version_aware", "check_connection",
          "skip_instance_cache", "use_listings_cache")


def _check_types(options: dict[str, Any]) -> None:
    """Refuse ill-typed values of the filesystem options whose type is known (a typo
    would fail later as a storage error); read "true"/"false" from the CLI as such."""
    for key in _MAPPINGS:
        if key in options and not isinstance(options[key], Mapping):
            raise ConfigError(f"storage option {key} must be a mapping (JSON object on the "
                              f"command line, e.g. -o '{key}={{...}}'), got {options[key]!r}")
    for key in _FLAGS:
        if key in options:
            options[key] = _flag(key, options[key])


def _own_options(options: dict[str, Any]) -> dict[str, Any]:
    """Pop and check the options that configure cloudckpt itself."""
    own: dict[str, Any] = {k: options.pop(k) for k in STORE_OPTIONS if k in options}
    for key in ("max_concurrency", "part_size"):
        if key in own:
            own[key] = _positive_int(key, own[key])
    retry = own.get("retry")
    if isinstance(retry, Mapping):
        try:
            own["retry"] = RetryPolicy(**retry)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid retry options {dict(retry)!r}: {exc}; the fields are "
                              "max_attempts, initial_backoff, max_backoff and deadline") from None
    elif retry is not None and not isinstance(retry, RetryPolicy):
        raise ConfigError("storage_options['retry'] must be a RetryPolicy or a dict")
    return own


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"storage option {key} must be a positive integer, got {value!r}")
    return value


def _flag(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ConfigError(f"storage option {key} must be true or false, got {value!r}")


def _check_names(scheme: str, options: Mapping[str, Any], known: frozenset[str] | None) -> None:
    """Refuse option names the filesystem does not take: a misspelt one would
    otherwise fail later as a storage error far from its cause."""
    if known is None:
        return
    unknown = sorted(set(options) - known)
    if not unknown:
        return
    hints, guessed = [], True
    for key in unknown:
        close = difflib.get_close_matches(key, sorted(known | set(STORE_OPTIONS)), n=1)
        hints.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
        guessed = guessed and bool(close)
    valid = "" if guessed else (f" cloudckpt's own: {', '.join(STORE_OPTIONS)}; the "
                                f"filesystem's: {', '.join(sorted(known))}.")
    raise ConfigError(f"unknown storage option{'s' if len(unknown) > 1 else ''} for "
                      f"{scheme}:// : {', '.join(hints)}.{valid} See docs/storage.md.")


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


def parse_options(pairs: Sequence[str] | None) -> dict[str, Any]:
    """Storage options from ``KEY=VALUE`` pairs (the command line's ``-o``): values are
    JSON when they parse as JSON, else strings."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"storage option {pair!r} must look like KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out
