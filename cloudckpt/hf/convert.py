"""Conversions out of DCP training checkpoints: to a Hugging Face export, or to a
``torch.save`` state dict (what a framework's own DCP converter writes).

Only the model's tensors are read: the keys under ``key_prefix`` are planned
alone, so DCP never fetches optimizer state.

Framework checkpoints are read through the DCP layouts their plug-ins declare
(:func:`cloudckpt.core.plugins.dcp_layouts`).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from cloudckpt import dcp as cdcp
from cloudckpt.core import kinds, plugins
from cloudckpt.core.checkpoint import open_checkpoint
from cloudckpt.errors import ConfigError
from cloudckpt.names import MODEL_PART
from cloudckpt.storage import Store, as_store, open_store, split_uri

log = logging.getLogger(__name__)


def auto_prefixes() -> tuple[str, ...]:
    """Prefixes tried, in order, when none is given: cloudckpt's manager's, each
    framework layout's, then none."""
    framework = dict.fromkeys(prefix for _, prefix in plugins.dcp_layouts().values())
    return ("model.", *framework, "")



def _dcp_store(uri: str | Store, storage_options: Mapping[str, Any] | None) -> Store:
    store = as_store(uri, storage_options)
    kind = open_checkpoint(store).manifest.kind
    if kind == kinds.TRAINING:
        return store.child(MODEL_PART)  # a manager/slot checkpoint: its DCP part
    layout = plugins.dcp_layouts().get(kind)
    if layout is not None:  # a framework's checkpoint: its model's DCP part
        return store.child(layout[0])
    return store


def model_state_from_dcp(uri: str | Store, *, key_prefix: str | None = None,
                         storage_options: Mapping[str, Any] | None = None
                         ) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint, full (unsharded), prefix stripped."""
    store = _dcp_store(uri, storage_options)
    metadata = cdcp.CloudStorageReader(store).read_metadata()
    tensors = {k: v for k, v in metadata.state_dict_metadata.items()
               if isinstance(v, TensorStorageMetadata)}
    prefixes = [key_prefix] if key_prefix is not None else list(auto_prefixes())
    for prefix in prefixes:
        keys = [k for k in tensors if k.startswith(prefix)]
        if keys:
            break
    else:
        raise ConfigError(f"{store.uri} has no tensors under {prefixes[0]!r}; its tensor keys "
                          f"start with: {sorted({k.split('.')[0] for k in tensors})}")
    state = {k: torch.empty(tuple(tensors[k].size), dtype=tensors[k].properties.dtype)
             for k in keys}
    cdcp.load(state, store)
    log.info("read %d model tensors (prefix %r) from %s", len(state), prefix, store.uri)
    return {k[len(prefix):]: v for k, v in state.items()}


def dcp_to_hf(src: str, dst: str, *, config: Mapping[str, Any], key_prefix: str | None = None,
              dtype: torch.dtype | None = None, max_shard_size: int | str = "5GB",
              storage_options: Mapping[str, Any] | None = None,
              dst_options: Mapping[str, Any] | None = None) -> Any:
    """Convert the model part of a DCP checkpoint into a committed HF export."""
    from cloudckpt.hf import export

    state = model_state_from_dcp(src, key_prefix=key_prefix, storage_options=storage_options)
    return export(state, dst, config=config, dtype=dtype, max_shard_size=max_shard_size,
                  storage_options=dst_options if dst_options is not None else storage_options,
                  metadata={"converted_from": src})


def dcp_to_pt(dcp_path: str, output_path: str, *, key_prefix: str | None = None,
              storage_options: Mapping[str, Any] | None = None) -> int:
    """Write the model part of a DCP checkpoint as a ``torch.save`` state dict
    (a local file or any URI); return the number of tensors."""
    state = model_state_from_dcp(dcp_path, key_prefix=key_prefix,
                                 storage_options=storage_options)
    buf = io.BytesIO()
    torch.save(state, buf)
    scheme, path = split_uri(output_path)
    parent, _, name = path.rstrip("/").rpartition("/")
    if not name:
        raise ConfigError(f"output path {output_path!r} names no file")
    root = f"{scheme}://{parent}" if scheme != "file" else (parent or ".")
    open_store(root, storage_options if scheme != "file" else None).put(name, buf.getvalue())
    return len(state)


DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
          "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}
