"""RLinf's names: the ``global_step_N/`` layout, its parts and keys, and the paths
built from ``runner.*``."""

from __future__ import annotations

import re

from cloudckpt.errors import ConfigError

KIND = "rlinf"
#: The kind of one part (actor, critic) that RLinf's strategy saved on a bucket.
PART_KIND = "rlinf-part"
CHECKPOINTS = "checkpoints"
STEP_PREFIX = "global_step_"
ACTOR = "actor"
CRITIC = "critic"
DCP_DIR = "dcp_checkpoint"
DATA_PATH = "data/data.pt"
#: Each rank's file of RLinf's ``local_shard`` format.
LOCAL_SHARD = "local_shard_checkpoint/checkpoint_rank_{rank}.pt"
#: RLinf's FSDP strategy also writes the gathered model of each part here (base.py,
#: ``save_full_model_weights=True`` by default), on rank 0, with ``torch.save``.
FULL_WEIGHTS = "model_state_dict/full_weights.pt"
#: RLinf's ``FSDPVersion`` values, stored as ``fsdp_checkpoint.fsdp_version``.
FSDP_VERSIONS = ("fsdp", "fsdp2")
#: RLinf's DCP state dict is ``{"fsdp_checkpoint": {model, optimizers, lr_schedulers,
#: fsdp_version, rng}}``; DCP flattens it, so model tensors are under this prefix.
ROOT_KEY = "fsdp_checkpoint"
KEY_PREFIX = f"{ROOT_KEY}.model."
STEP_RE = re.compile(rf"^{STEP_PREFIX}(\d+)$")



def checkpoints_root(output_dir: str, experiment_name: str) -> str:
    """``{output_dir}/{experiment_name}/checkpoints`` (``output_dir`` may be a URI)."""
    if not output_dir or not experiment_name:
        raise ConfigError("runner.output_dir and runner.experiment_name must both be set")
    return f"{str(output_dir).rstrip('/')}/{experiment_name.strip('/')}/{CHECKPOINTS}"


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{int(step)}"


def step_of_part(uri: str) -> int | None:
    """The step of ``.../global_step_N/<part>`` (None when not named so)."""
    parent = str(uri).rstrip("/").rpartition("/")[0].rpartition("/")[2]
    m = STEP_RE.match(parent)
    return int(m.group(1)) if m else None


def parse_step(uri: str) -> int:
    """The step RLinf resumes at, from the directory name: ``.../global_step_150/`` -> 150.

    RLinf takes ``int(resume_dir.split("global_step_")[-1])``; the same names parse
    here (plus a trailing slash), anything else is refused by name instead of a
    bare ``ValueError``."""
    name = str(uri).rstrip("/").rpartition("/")[2]
    m = STEP_RE.match(name)
    if not m:
        raise ConfigError(f"resume_dir {uri!r} does not end in {STEP_PREFIX}<N>; RLinf takes "
                          "the resumed step from that name (use null for a fresh start, "
                          "auto for the newest step)")
    return int(m.group(1))
