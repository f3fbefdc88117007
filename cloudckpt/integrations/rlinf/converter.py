"""RLinf's ``--dcp_path/--output_path`` converter, for URIs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from cloudckpt.core import kinds
from cloudckpt.core.checkpoint import open_checkpoint
from cloudckpt.errors import CheckpointNotFoundError, IncompleteCheckpointError
from cloudckpt.integrations.rlinf.layout import ACTOR, DCP_DIR, KEY_PREFIX


def convert(dcp_path: str, output_path: str, *,
            storage_options: Mapping[str, Any] | None = None) -> int:
    """RLinf's ``--dcp_path/--output_path`` conversion, for URIs: the model tensors of
    an actor DCP checkpoint as a ``torch.save`` state dict. ``dcp_path`` may be the
    ``dcp_checkpoint`` prefix, ``actor/`` or the whole ``global_step_N``."""
    from cloudckpt.hf.convert import dcp_to_pt

    src = _dcp_part(dcp_path.rstrip("/"), storage_options)
    return dcp_to_pt(src, output_path, key_prefix=KEY_PREFIX, storage_options=storage_options)


def _dcp_part(uri: str, storage_options: Mapping[str, Any] | None) -> str:
    for candidate in (uri, f"{uri}/{DCP_DIR}", f"{uri}/{ACTOR}/{DCP_DIR}"):
        try:
            ckpt = open_checkpoint(candidate, storage_options)
        except (CheckpointNotFoundError, IncompleteCheckpointError):
            continue
        if ckpt.manifest.kind == kinds.DCP:
            return candidate
    raise CheckpointNotFoundError(
        f"no committed DCP checkpoint at {uri} (nor at {uri}/{DCP_DIR} or "
        f"{uri}/{ACTOR}/{DCP_DIR})")
