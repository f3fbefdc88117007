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

The package: ``plugin`` (the declaration), ``binding`` (what activation binds),
``commands`` (``cloudckpt rlinf ...``), ``layout`` (RLinf's names and paths),
``resume`` (``runner.resume_dir``), then one module per job: ``config`` (``runner.*``
keys, ``max_steps``, the ``save_interval`` rule), ``fsdp`` (the actor's state dict,
RNG, full weights), ``checkpointer`` (:class:`RLinfCheckpointer`), ``adoption`` (steps
RLinf wrote), ``converter`` (RLinf's DCP -> ``torch.save`` tool), ``strategy`` and
``runner`` (RLinf's FSDP strategy and runner on a bucket), ``localpaths`` (where its
local files go) and ``doctor`` (a launch, read).
"""

from cloudckpt.util.lazy import lazy_exports

__getattr__ = lazy_exports(__name__, {
    "adoption": ("adopt_step", "upload_step"),
    "checkpointer": ("RLinfCheckpointer", "Resumed", "SaveOptions", "read_data_state"),
    "cloudckpt.core.checkpoint": ("CheckpointWriter",),
    "config": ("RunnerConfig", "should_save", "total_steps"),
    "converter": ("convert",),
    "fsdp": ("fsdp_state_dict", "get_rng_state", "load_fsdp_state_dict", "set_rng_state"),
    "layout": (
        "ACTOR",
        "CHECKPOINTS",
        "CRITIC",
        "DATA_PATH",
        "DCP_DIR",
        "FULL_WEIGHTS",
        "KEY_PREFIX",
        "KIND",
        "ROOT_KEY",
        "STEP_PREFIX",
        "checkpoints_root",
        "parse_step",
        "step_name",
    ),
    "resume": ("open_rlinf_checkpoint", "resolve_resume_dir"),
})

__all__ = [
    "KEY_PREFIX",
    "RLinfCheckpointer",
    "Resumed",
    "RunnerConfig",
    "SaveOptions",
    "adopt_step",
    "checkpoints_root",
    "convert",
    "fsdp_state_dict",
    "get_rng_state",
    "load_fsdp_state_dict",
    "parse_step",
    "resolve_resume_dir",
    "set_rng_state",
    "should_save",
    "total_steps",
    "upload_step",
]
