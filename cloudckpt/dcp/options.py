"""torch's ``FileSystemWriter`` options, as :class:`~cloudckpt.dcp.CloudStorageWriter`
takes them: each mapped to cloudckpt's own setting where it has a meaning here, or
refused with a :class:`~cloudckpt.errors.ConfigError` saying why (never a bare
``TypeError``), so that code written for torch's writer runs unchanged or is told what
to change before anything is written."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cloudckpt.errors import ConfigError
from cloudckpt.storage import split_uri


@dataclass(frozen=True)
class TorchOptions:
    """The options of torch's writer a caller gave (None: not given)."""

    thread_count: int | None = None
    single_file_per_rank: bool = True
    sync_files: bool = True
    per_thread_copy_ahead: int | None = None
    extensions: Sequence[Any] | None = None
    serialization_format: Any = None


def flag(name: str, value: Any) -> bool:
    """``value`` of the yes-or-no option ``name``, refused unless a bool (``"no"`` is
    true to Python: a typo must not flip the meaning)."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return value


def check(opts: TorchOptions) -> None:
    """Refuse what cloudckpt's writer cannot honour, saying why."""
    flag("single_file_per_rank", opts.single_file_per_rank)
    flag("sync_files", opts.sync_files)
    for name, value, low in (("thread_count", opts.thread_count, 1),
                             ("per_thread_copy_ahead", opts.per_thread_copy_ahead, 0)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < low):
            raise ConfigError(f"{name} must be an integer of at least {low}, got {value!r}")
    if opts.extensions:
        raise ConfigError(
            f"_extensions={list(opts.extensions)!r}: cloudckpt writes no stream transforms "
            "(compression, encryption): its reader fetches each tensor's bytes by range "
            "straight into the tensor and checks each item's CRC32C, which a transformed "
            "stream does not allow. Drop _extensions (the bucket can encrypt at rest).")
    fmt = getattr(opts.serialization_format, "value", opts.serialization_format)
    if fmt not in (None, "torch_save"):
        raise ConfigError(
            f"serialization_format={opts.serialization_format!r}: cloudckpt writes DCP's "
            "torch.save format, which torch's FileSystemReader reads once downloaded; for "
            "safetensors, export the checkpoint (cloudckpt.hf).")


def max_files(opts: TorchOptions, given: int | None, default: int) -> int:
    """``thread_count`` is how many files each rank writes at once with torch's writer
    (one per thread): here the most files a rank writes, each uploaded in parallel
    parts. ``max_files`` says the same, so not both."""
    if opts.thread_count is not None and given is not None:
        raise ConfigError("pass thread_count (torch's name) or max_files, not both: both set "
                          "how many files each rank writes at once")
    return opts.thread_count or given or default


def storage_options(uri: Any, opts: TorchOptions,
                    given: Mapping[str, Any] | None) -> dict[str, Any]:
    """``sync_files=False`` on a local path: its files are not fsynced (the store's
    ``fsync`` option), as with torch's writer. Uploads to a bucket are durable once they
    return, whatever it says."""
    out = dict(given or {})
    if not opts.sync_files and isinstance(uri, (str, os.PathLike)) \
            and split_uri(os.fspath(uri))[0] == "file":
        out.setdefault("fsync", False)
    return out
