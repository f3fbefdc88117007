"""ROLL's layout: its checkpoints ``{output_dir}/checkpoint-N/`` (ROLL's merged layout:
every worker's files side by side), how they are named and ordered, and where
cloudckpt's part markers lie inside one."""

from __future__ import annotations

import re

KIND = "roll"
#: Where each ROLL worker's part marker lies inside a checkpoint (one per part).
PARTS_DIR = "_cloudckpt_parts"
#: ROLL's checkpoint directory names.
CKPT_RE = re.compile(r"^checkpoint-(\d+)$")
#: The pipeline's state: ROLL's resume reads it before anything else.
PIPELINE_STATE = "pipeline/worker_state_pipeline.json"


def checkpoint_order(name: str) -> tuple[int, str]:
    """Sort key of checkpoint names: ``checkpoint-9`` before ``checkpoint-11``; other
    names first."""
    m = CKPT_RE.match(name)
    return (int(m.group(1)) if m else -1, name)
