"""Storage options: parsed from the command line, split into cloudckpt's own and
the filesystem's, and checked before anything is sent.

:func:`own_options` takes ``retry``, ``max_concurrency``, ``part_size``,
``upload_window`` and ``conditional_writes`` out of
a user's storage options (the registry passes them to the backend as keyword
arguments). Each backend checks the rest itself (:meth:`Store._read_options`):
:func:`check_filesystem_options` against the names its filesystem takes, or
:func:`refuse_options` where the filesystem takes none.
"""

from __future__ import annotations

import difflib
import inspect
import json
from collections.abc import Mapping, Sequence
from typing import Any

from cloudckpt.errors import ConfigError
from cloudckpt.storage.retry import RetryPolicy

#: Default number of requests a batch keeps in flight.
DEFAULT_CONCURRENCY = 16
#: Default part size of streamed (multipart) writes.
DEFAULT_PART_SIZE = 16 * 1024 * 1024
#: Default upload window: the bytes every streamed write of the process may hold at
#: once, in parts being filled and parts in flight (stores with one value share it).
DEFAULT_UPLOAD_WINDOW = 8 * DEFAULT_PART_SIZE

#: storage_options keys that configure cloudckpt itself rather than the filesystem.
STORE_OPTIONS = ("retry", "max_concurrency", "part_size", "upload_window", "conditional_writes")

#: Filesystem options that must be mappings, and those that are switches.
_MAPPINGS = ("client_kwargs", "config_kwargs", "s3_additional_kwargs", "session_kwargs")
_FLAGS = ("anon", "use_ssl", "requester_pays", "version_aware", "check_connection",
          "skip_instance_cache", "use_listings_cache")


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


def own_options(options: dict[str, Any]) -> dict[str, Any]:
    """Pop and check the options that configure cloudckpt itself."""
    own: dict[str, Any] = {k: options.pop(k) for k in STORE_OPTIONS if k in options}
    for key in ("max_concurrency", "part_size", "upload_window"):
        if key in own:
            own[key] = positive_int(key, own[key])
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


def positive_int(key: str, value: Any) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"storage option {key} must be a positive integer, got {value!r}")
    return value


def flag(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ConfigError(f"storage option {key} must be true or false, got {value!r}")


def init_options(fs_class: type) -> frozenset[str]:
    """The keyword arguments ``fs_class`` and its bases name in ``__init__``, and those
    every fsspec filesystem takes (its instance and listings caches)."""
    names = {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"}
    for klass in fs_class.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                names.add(p.name)
    return frozenset(names)


def check_filesystem_options(scheme: str, options: dict[str, Any],
                             known: frozenset[str] | None) -> None:
    """Refuse option names the filesystem does not take (``known``; None: any, and
    nothing is checked), then ill-typed values of those whose type is known."""
    if known is None:
        return
    _check_names(scheme, options, known)
    _check_types(options)


def refuse_options(scheme: str, options: Mapping[str, Any], allowed: Sequence[str] = ()) -> None:
    """For backends whose filesystem takes no options: refuse whatever is left."""
    if options:
        raise ConfigError(
            f"unknown storage options for {scheme}:// : {sorted(options)}; "
            f"allowed: {sorted(STORE_OPTIONS) + list(allowed)}"
        )


def refuse_own_options(backend: str, options: Mapping[str, Any]) -> None:
    """cloudckpt's own options are keyword arguments of a backend's constructor (only
    :func:`~cloudckpt.storage.open_store` takes them among the storage options)."""
    for key in STORE_OPTIONS:
        if key in options:
            raise ConfigError(f"{key} is a keyword argument of {backend}, not one of its "
                              f"storage_options: pass {backend}(root, {key}=...)")


def _check_types(options: dict[str, Any]) -> None:
    """Refuse ill-typed values of the filesystem options whose type is known (a typo
    would fail later as a storage error); read "true"/"false" from the CLI as such."""
    for key in _MAPPINGS:
        if key in options and not isinstance(options[key], Mapping):
            raise ConfigError(f"storage option {key} must be a mapping (JSON object on the "
                              f"command line, e.g. -o '{key}={{...}}'), got {options[key]!r}")
    for key in _FLAGS:
        if key in options:
            options[key] = flag(key, options[key])


def _check_names(scheme: str, options: Mapping[str, Any], known: frozenset[str]) -> None:
    """Refuse option names the filesystem does not take: a misspelt one would
    otherwise fail later as a storage error far from its cause."""
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
