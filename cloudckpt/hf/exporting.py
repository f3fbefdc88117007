"""Hugging Face exports in object storage: safetensors + config + tokenizer.

:func:`export` writes what ``transformers``' ``save_pretrained`` writes —
``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` shards and
``model.safetensors.index.json``), ``config.json``, ``generation_config.json``,
tokenizer files — straight to any cloudckpt URI, committed with a manifest.
Each shard is streamed into a multipart upload as it is serialised, so the
extra host memory is the parts in flight, not the model.

:func:`load_state_dict`, :func:`download` and :func:`from_pretrained` read an
export back, every byte checked against the manifest's CRC32C.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import tempfile
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from cloudckpt.compat.transformers_private import tied_weight_keys
from cloudckpt.core import kinds
from cloudckpt.core.checkpoint import Checkpoint, CheckpointWriter, open_checkpoint
from cloudckpt.dcp.metadata import pack_item_crcs
from cloudckpt.errors import ConfigError, CorruptCheckpointError
from cloudckpt.hf.hub import HUB_FILE_LIMIT
from cloudckpt.hf.lazy import TENSOR_CRCS
from cloudckpt.movement.checkpoint_copy import download  # noqa: F401 - public here as hf.download
from cloudckpt.util.crc import crc32c_hex

log = logging.getLogger(__name__)

__all__ = ["download", "export", "from_pretrained", "load_state_dict", "parse_size"]

KIND = kinds.HF
#: Shards serialised and uploaded at once.
SHARD_WORKERS = 4
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"),
                     ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """``"5GB"`` → 5_000_000_000 (``"5GiB"`` → 5 * 2**30), as transformers reads it."""
    if isinstance(size, int):
        if size <= 0:
            raise ConfigError(f"size must be positive, got {size}")
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
    if not m or m.group(2) not in _UNITS:
        raise ConfigError(f"cannot read size {size!r}: write e.g. '5GB', '500MB' or bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


# ---------------------------------------------------------------------- export


def export(
    model_or_state_dict: Any,
    uri: str,
    *,
    config: Mapping[str, Any] | Any | None = None,
    tokenizer: Any = None,
    generation_config: Mapping[str, Any] | Any | None = None,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    storage_options: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    takeover: bool = False,
) -> Checkpoint:
    """Write a Hugging Face model folder to ``uri`` and commit it.

    ``model_or_state_dict``: a ``transformers`` model (its config, generation
    config and tied-weight names are used) or a plain state dict (then pass
    ``config`` as a dict). ``tokenizer``: a ``transformers`` tokenizer, a local
    directory of tokenizer files, or ``{filename: bytes}``. ``dtype`` converts
    floating-point tensors. Tensors that share memory (tied weights) are stored
    once, as ``save_pretrained`` does. ``takeover`` replaces the writer claim of
    an earlier export of ``uri`` that died on another host (for a trainer that owns
    its export directories and re-exports a step after a restart).
    """
    state, tied = _state_of(model_or_state_dict)
    config_doc = _config_doc(config if config is not None
                             else getattr(model_or_state_dict, "config", None))
    if config_doc is None:
        raise ConfigError("export needs a config: pass config= (a dict or a transformers "
                          "PretrainedConfig) when exporting a plain state dict")
    gen = generation_config
    if gen is None and _can_generate(model_or_state_dict):
        gen = getattr(model_or_state_dict, "generation_config", None)
    gen_doc = _config_doc(gen)
    state = _drop_shared(state, tied)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        # "dtype" since transformers 4.56; "torch_dtype" for the releases before it.
        config_doc["dtype"] = config_doc["torch_dtype"] = str(dtype).removeprefix("torch.")
    shards = _plan_shards(state, parse_size(max_shard_size), HUB_FILE_LIMIT)
    files = [SINGLE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    with CheckpointWriter(uri, kind=KIND, storage_options=storage_options, takeover=takeover,
                          metadata={**dict(metadata or {}), "format": "safetensors",
                                    "files": files}) as writer:
        weight_map = {k: name for name, keys in zip(files, shards, strict=True) for k in keys}

        crcs: list[tuple[str, int, str]] = []

        def write_shard(job: tuple[str, list[str]]) -> None:
            with writer.open(job[0]) as out:
                placed = _write_safetensors(out, {k: state[k] for k in job[1]})
            crcs.extend((job[0], start, crc) for start, crc in placed)

        # A few shards at once: each streams into its own upload, so memory is
        # bounded by the uploads' buffers while requests keep the link busy.
        with ThreadPoolExecutor(min(len(shards), SHARD_WORKERS),
                                thread_name_prefix="cloudckpt-shard") as pool:
            list(pool.map(write_shard, zip(files, shards, strict=True)))
        # A CRC32C per tensor: a ranged read of one tensor is checked on its own, and
        # `cloudckpt diff` tells changed tensors from their checksums alone.
        writer.metadata = {**writer.metadata, TENSOR_CRCS: pack_item_crcs(crcs)}
        if len(shards) > 1:
            total = sum(_nbytes(t) for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(
                weight_map.items()))}
            writer.put(INDEX, _json(index))
        extra = {"config.json": _json(config_doc)}
        if gen_doc is not None:
            extra["generation_config.json"] = _json(gen_doc)
        extra.update(_tokenizer_files(tokenizer))
        writer.put_many(extra)
    ckpt = writer.commit()  # as committed: opened again, a part of a save under way is refused
    log.info("exported %d tensors in %d file(s) to %s", len(state), len(files), ckpt.uri)
    return ckpt


def _state_of(obj: Any) -> tuple[dict[str, torch.Tensor], set[str]]:
    if isinstance(obj, torch.nn.Module):
        return dict(obj.state_dict()), tied_weight_keys(obj)
    if isinstance(obj, Mapping):
        bad = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise ConfigError(f"state dict values must be tensors; not: {bad[:5]}")
        return dict(obj), set()
    raise ConfigError(f"export takes a torch.nn.Module or a state dict, not {type(obj).__name__}")


def _can_generate(obj: Any) -> bool:
    fn = getattr(obj, "can_generate", None)
    try:
        return bool(fn()) if callable(fn) else False
    except Exception:  # noqa: BLE001 - a model that cannot tell cannot generate
        return False


def _config_doc(cfg: Any) -> dict[str, Any] | None:
    if cfg is None:
        return None
    if isinstance(cfg, Mapping):
        return dict(cfg)
    if hasattr(cfg, "to_json_string"):
        return json.loads(cfg.to_json_string())
    if hasattr(cfg, "to_dict"):
        return dict(cfg.to_dict())
    raise ConfigError(f"cannot serialise config of type {type(cfg).__name__}")


def _drop_shared(state: dict[str, torch.Tensor], tied: Iterable[str]) -> dict[str, torch.Tensor]:
    """Store tensors that share memory once: drop the tied names (transformers'
    ``_tied_weights_keys``), else all but the first name of each group."""
    tied = set(tied)
    groups: dict[tuple, list[str]] = {}
    for name, t in state.items():
        if t.device.type == "meta" or t.numel() == 0:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        groups.setdefault(key, []).append(name)
    drop: set[str] = set()
    for names in groups.values():
        if len(names) > 1:
            keep = next((n for n in names if n not in tied), names[0])
            drop.update(n for n in names if n != keep)
    if drop:
        log.info("storing shared tensors once; dropped: %s", sorted(drop))
    return {k: v for k, v in state.items() if k not in drop}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _plan_shards(state: Mapping[str, torch.Tensor], max_bytes: int, limit: int
                 ) -> list[list[str]]:
    """Greedy in state-dict order, a new shard when the next tensor would overflow
    ``max_bytes``, or take the file, header included, past ``limit`` (the Hub's per-file
    limit: every shard of an export can be pushed)."""
    if max_bytes > limit:
        log.warning("max_shard_size %d is above the Hub's limit of %d bytes per file; "
                    "shards are kept below the limit", max_bytes, limit)
    shards: list[list[str]] = [[]]
    size, file = 0, _HEADER_BASE  # the shard's tensor bytes; its file's, at most
    for name, t in state.items():
        n, entry = _nbytes(t), _header_bound(name, t)
        if _HEADER_BASE + entry + n > limit:
            raise ConfigError(
                f"tensor {name!r} is {n} bytes: a file holding it would be above the Hub's "
                f"limit of {limit} bytes per file, and a tensor cannot be split across "
                "shards; such a model cannot be exported for the Hub")
        if shards[-1] and (size + n > max_bytes or file + entry + n > limit):
            shards.append([])
            size, file = 0, _HEADER_BASE
        shards[-1].append(name)
        size += n
        file += entry + n
    return shards


#: Bytes of a safetensors file besides its tensors' entries: the length, the metadata
#: entry, braces and padding.
_HEADER_BASE = 64


def _header_bound(name: str, t: torch.Tensor) -> int:
    """An upper bound on the bytes ``name``'s entry takes in a safetensors header."""
    entry = {name: {"dtype": "F8_E4M3", "shape": list(t.shape), "data_offsets": [2**64] * 2}}
    return len(json.dumps(entry))


def _write_safetensors(out: Any, tensors: Mapping[str, torch.Tensor]) -> list[tuple[int, str]]:
    """Stream one safetensors file: 8-byte header length, JSON header, raw data; return
    each tensor's first byte in the file and the CRC32C of its bytes."""
    names = sorted(tensors)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        t = tensors[name]
        if t.dtype not in _DTYPES:
            raise ConfigError(f"tensor {name!r} has dtype {t.dtype}, which safetensors "
                              "cannot store")
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + _nbytes(t)]}
        offset += _nbytes(t)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    out.write(struct.pack("<Q", len(raw)))
    out.write(raw)
    placed = []
    pos = 8 + len(raw)
    for name in names:
        t = tensors[name].detach()
        if t.device.type != "cpu":
            t = t.to("cpu", non_blocking=False)
        t = t.contiguous().reshape(-1)
        data = memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")  # type: ignore[arg-type]  # numpy's stubs: a buffer from 3.12
        placed.append((pos, crc32c_hex(data)))
        pos += data.nbytes
        if data.nbytes:  # the tensor's own memory: the upload copies only what it buffers
            out.write(data)
    return placed


def _tokenizer_files(tokenizer: Any) -> dict[str, bytes]:
    if tokenizer is None:
        return {}
    if isinstance(tokenizer, Mapping):
        return {str(k): bytes(v) for k, v in tokenizer.items()}
    if isinstance(tokenizer, (str, os.PathLike)):
        root = Path(tokenizer)
        if not root.is_dir():
            raise ConfigError(f"tokenizer directory {root} does not exist")
        return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}
    if hasattr(tokenizer, "save_pretrained"):
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
            return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}
    raise ConfigError(f"cannot export a tokenizer of type {type(tokenizer).__name__}")


def _json(doc: Any) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


# -------------------------------------------------------------------- reading


def _open_export(uri: str | Checkpoint, storage_options: Mapping[str, Any] | None) -> Checkpoint:
    ckpt = uri if isinstance(uri, Checkpoint) else open_checkpoint(uri, storage_options)
    if SINGLE not in ckpt.files and INDEX not in ckpt.files:
        raise CorruptCheckpointError(
            f"{ckpt.uri} is not a Hugging Face export: it has neither {SINGLE} nor {INDEX}")
    return ckpt


def weight_files(ckpt: Checkpoint) -> list[str]:
    """The safetensors files of an export, from its index when sharded."""
    if INDEX not in ckpt.files:
        return [SINGLE]
    index = json.loads(ckpt.read(INDEX))
    files = sorted(set(index.get("weight_map", {}).values()))
    missing = [f for f in files if f not in ckpt.files]
    if missing:
        raise CorruptCheckpointError(f"{ckpt.uri}: the index names files the manifest lacks: "
                                     f"{missing}", {f: "missing" for f in missing})
    return files


def load_state_dict(uri: str | Checkpoint, storage_options: Mapping[str, Any] | None = None
                    ) -> dict[str, torch.Tensor]:
    """All tensors of an export (shards read with parallel ranged reads, checked)."""
    from safetensors.torch import load

    ckpt = _open_export(uri, storage_options)
    state: dict[str, torch.Tensor] = {}
    for name in weight_files(ckpt):
        state.update(load(ckpt.read(name)))
    return state


def cache_dir() -> Path:
    """Where :func:`from_pretrained` keeps downloads (``CLOUDCKPT_CACHE``, or
    ``~/.cache/cloudckpt``)."""
    return Path(os.environ.get("CLOUDCKPT_CACHE", Path.home() / ".cache" / "cloudckpt"))


def from_pretrained(cls: Any, uri: str, *, storage_options: Mapping[str, Any] | None = None,
                    **kwargs: Any) -> Any:
    """``cls.from_pretrained`` on an export in a bucket, via a local cache keyed by
    the export's commit id (a re-export at the same URI is a new commit)."""
    ckpt = open_checkpoint(uri, storage_options)
    local = download(ckpt, cache_dir() / "hf" / ckpt.manifest.commit_id)
    return cls.from_pretrained(str(local), **kwargs)
