"""RLinf's FSDP strategy I/O on a bucket: what ``FSDPStrategyBase.save_checkpoint`` /
``load_checkpoint`` do (``rlinf/hybrid_engines/fsdp/strategy/base.py``) when the path
is a bucket URI, as one committed part per call.

A part (``.../global_step_N/actor``) is committed at that prefix (kind
:data:`~cloudckpt.integrations.rlinf.layout.PART_KIND`) with RLinf's files: the DCP
shards of RLinf's own ``Checkpoint`` state (``dcp_checkpoint/``) or each rank's
``local_shard_checkpoint/checkpoint_rank_{R}.pt``, and ``model_state_dict/
full_weights.pt``. A crash mid-save leaves no committed part, so nothing resumes it.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Mapping
from typing import Any

from cloudckpt.core.checkpoint import Checkpoint, open_checkpoint
from cloudckpt.core.expected import expect_kind, expect_step, expect_world_size
from cloudckpt.errors import ConfigError
from cloudckpt.integrations.rlinf.fsdp import fsdp_parts
from cloudckpt.integrations.rlinf.layout import (
    DCP_DIR,
    LOCAL_SHARD,
    PART_KIND,
    ROOT_KEY,
    step_of_part,
)
from cloudckpt.runtime import coordination as coord
from cloudckpt.runtime.state import resolve_stateful
from cloudckpt.serialization.torchload import numpy_rng_allowed, torch_bytes
from cloudckpt.storage import open_store
from cloudckpt.training import multipart

log = logging.getLogger(__name__)

FORMATS = ("dcp", "local_shard")


def _format(checkpoint_format: str) -> str:
    if checkpoint_format not in FORMATS:
        raise ConfigError(f"checkpoint_format must be one of {FORMATS} (RLinf's), got "
                          f"{checkpoint_format!r}")
    return checkpoint_format


def save_part(training_state: Any, save_path: str, *, checkpoint_format: str = "dcp",
              full_weights: Callable[[], Any] | None = None,
              storage_options: Mapping[str, Any] | None = None) -> Checkpoint | None:
    """Commit RLinf's ``Checkpoint`` state (a ``Stateful``) at ``save_path``, a bucket
    URI; call on every rank of the default group. ``full_weights`` (called on every
    rank after the shards, as RLinf's gather) returns the full model state dict on
    rank 0, saved as ``model_state_dict/full_weights.pt``. Returns the part on rank 0."""
    fmt = _format(checkpoint_format)
    store = open_store(save_path.rstrip("/"), storage_options)
    step = step_of_part(save_path)
    state = resolve_stateful({ROOT_KEY: training_state})  # taken once, as RLinf's dcp.save
    gather = None
    if full_weights is not None:
        def gather(group: Any) -> bytes | None:
            full = full_weights()
            return torch_bytes(full) if coord.rank(group) == 0 else None
    parts = fsdp_parts("", state, step, full_weights is not None, gather=gather)
    if fmt == "local_shard":  # each rank's own file instead of the DCP shards
        parts[0] = multipart.RankBytes(lambda r: LOCAL_SHARD.format(rank=r),
                                       torch_bytes(state[ROOT_KEY]))
    import torch.distributed as dist

    meta = {"format": fmt, "world_size": dist.get_world_size(), "layout": "rlinf-fsdp"}
    committed = multipart.save(store, parts, step=step, kind=PART_KIND, metadata=meta)
    if committed is not None:
        log.info("committed RLinf part %s (%s, %d files)", committed.uri, fmt,
                 len(committed.files))
    return committed


def load_part(training_state: Any, load_path: str, *, checkpoint_format: str = "dcp",
              fsdp_version: Any = None,
              storage_options: Mapping[str, Any] | None = None) -> Checkpoint:
    """Load a committed part into RLinf's ``Checkpoint`` state, in place; every rank.
    Its kind, step, format and (local shards) world size are checked first, and RLinf's
    FSDP version of a local shard: a refusal leaves the model as it was."""
    from cloudckpt import dcp as cdcp
    from cloudckpt.serialization.torchload import safe_torch_load

    fmt = _format(checkpoint_format)
    ckpt = open_checkpoint(load_path.rstrip("/"), storage_options)
    expect_step(expect_kind(ckpt, PART_KIND, "an RLinf part"), step_of_part(ckpt.uri))
    saved = ckpt.metadata.get("format")
    if saved != fmt:
        raise ConfigError(f"{ckpt.uri} was saved with checkpoint_format {saved!r}, and this "
                          f"run loads {fmt!r}: set the same format as the run that saved it")
    if fmt == "local_shard":
        import torch.distributed as dist

        world = ckpt.metadata.get("world_size")
        if isinstance(world, int):
            expect_world_size(ckpt.uri, world, dist.get_world_size(),
                              holds="local shards (checkpoint_format local_shard, which does "
                              "not reshard)",
                              otherwise=", or save with checkpoint_format dcp, which reshards")
        key = LOCAL_SHARD.format(rank=dist.get_rank())
        with numpy_rng_allowed():
            state = safe_torch_load(io.BytesIO(ckpt.read(key)), f"{ckpt.uri}/{key}")
        if fsdp_version is not None and state.get("fsdp_version") != getattr(
                fsdp_version, "value", fsdp_version):
            raise ConfigError(f"FSDP version mismatch: {state.get('fsdp_version')} != "
                              f"{fsdp_version}")
        training_state.load_state_dict(state)
    else:
        with numpy_rng_allowed():
            cdcp.load({ROOT_KEY: training_state}, ckpt.store.child(DCP_DIR))
    log.info("loaded RLinf part %s (%s)", ckpt.uri, fmt)
    return ckpt
