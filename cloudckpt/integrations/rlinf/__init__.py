"""RLinf on object storage: ``runner.*`` keys and the ``global_step_N/`` layout, crash-safe.

RLinf's FSDP backend writes, per saved step::

    {output_dir}/{experiment_name}/checkpoints/global_step_{N}/
        actor/dcp_checkpoint/{.metadata, __{rank}_{i}.distcp}   DCP, keys fsdp_checkpoint.*
        actor/model_state_dict/full_weights.pt                   gathered model, rank 0
        critic/...                                               optional, same shape
        data/data.pt                                             torch.save(dataloader state)

This module writes the same layout to any cloudckpt URI (``s3://``, ``gs://``,
a path). Each DCP part is committed by its own manifest (all ranks write their
shards in parallel), ``data/data.pt`` is written after them, and then one root
manifest ``global_step_{N}/cloudckpt-manifest.json`` lists every object of every
part with its CRC32C. Until that manifest exists the step is invisible: a crash
at any point leaves the previous step as the latest, where RLinf's
``resume_dir: auto`` takes the highest ``global_step_*`` directory that exists,
half-written or not. The DCP keys and value types are RLinf's own, so RLinf's
``Checkpoint`` loads a downloaded step, and a step RLinf wrote is adopted
(``adoption``) and then resumes here.

Our DCP writer names shard files ``__{rank}_{i}.distcp`` (``i`` > 0 when a
rank's items are split over several files); ``.metadata`` records every name,
so stock DCP readers load them as usual.

The package has one module per job: ``layout`` (RLinf's names and paths), ``config``
(``runner.*`` keys, ``max_steps``, the ``save_interval`` rule), ``fsdp`` (the actor's
state dict, RNG, full weights), ``checkpointer`` (:class:`RLinfCheckpointer`),
``resume`` (``runner.resume_dir``), ``adoption`` (steps RLinf wrote), ``converter``
(RLinf's DCP -> ``torch.save`` tool) and ``command`` (``python -m
cloudckpt.integrations.rlinf``).
"""

# Public names outside __all__ (as before the split) are re-exported as ``X as X``;
# CheckpointWriter is the class RLinfCheckpointer commits with (examples/rlinf patches it).
from cloudckpt.core.checkpoint import CheckpointWriter as CheckpointWriter
from cloudckpt.integrations.rlinf.adoption import adopt_step, upload_step
from cloudckpt.integrations.rlinf.checkpointer import Resumed, RLinfCheckpointer
from cloudckpt.integrations.rlinf.checkpointer import read_data_state as read_data_state
from cloudckpt.integrations.rlinf.command import main
from cloudckpt.integrations.rlinf.config import RunnerConfig, should_save, total_steps
from cloudckpt.integrations.rlinf.converter import convert
from cloudckpt.integrations.rlinf.fsdp import (
    fsdp_state_dict,
    get_rng_state,
    load_fsdp_state_dict,
    set_rng_state,
)
from cloudckpt.integrations.rlinf.layout import ACTOR as ACTOR
from cloudckpt.integrations.rlinf.layout import CHECKPOINTS as CHECKPOINTS
from cloudckpt.integrations.rlinf.layout import CRITIC as CRITIC
from cloudckpt.integrations.rlinf.layout import DATA_PATH as DATA_PATH
from cloudckpt.integrations.rlinf.layout import DCP_DIR as DCP_DIR
from cloudckpt.integrations.rlinf.layout import FULL_WEIGHTS as FULL_WEIGHTS
from cloudckpt.integrations.rlinf.layout import KEY_PREFIX, checkpoints_root, parse_step
from cloudckpt.integrations.rlinf.layout import KIND as KIND
from cloudckpt.integrations.rlinf.layout import ROOT_KEY as ROOT_KEY
from cloudckpt.integrations.rlinf.layout import STEP_PREFIX as STEP_PREFIX
from cloudckpt.integrations.rlinf.layout import step_name as step_name
from cloudckpt.integrations.rlinf.resume import open_rlinf_checkpoint as open_rlinf_checkpoint
from cloudckpt.integrations.rlinf.resume import resolve_resume_dir

__all__ = [
    "KEY_PREFIX",
    "RLinfCheckpointer",
    "Resumed",
    "RunnerConfig",
    "adopt_step",
    "checkpoints_root",
    "convert",
    "fsdp_state_dict",
    "get_rng_state",
    "load_fsdp_state_dict",
    "main",
    "parse_step",
    "resolve_resume_dir",
    "set_rng_state",
    "should_save",
    "total_steps",
    "upload_step",
]
