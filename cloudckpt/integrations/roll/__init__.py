"""ROLL: checkpoint uploaders for ``s3`` and ``gcs`` that commit atomically.

ROLL's ``CheckpointManager`` pops ``type`` from ``checkpoint_config``, looks
it up in ``roll.utils.upload_utils.uploader_registry`` and calls
``cls(**rest)``; every worker (the pipeline and each rank of each cluster)
then calls ``upload(ckpt_id, local_state_path)`` with its own local directory,
whose contents are merged into ``{output_dir}/{ckpt_id}/``. ROLL has no
"complete" marker, so a crash mid-upload leaves a torn ``checkpoint-N`` that
``get_latest_ckpt`` happily returns.

Here each ``upload`` is one *part*: its files go to ``{output_dir}/{ckpt_id}/``
(ROLL's merged layout, unchanged), each with its CRC32C, and then a small part
marker ``{ckpt_id}/_cloudckpt_parts/{part}.json`` lists them. The checkpoint is
committed (cloudckpt manifest, written create-only, listing every object)

- automatically by whichever uploader completes it: without a count, the parts declare
  the set they belong to (the pipeline, naming every checkpoint cluster of ROLL's
  pipeline; every rank of each cluster: ``membership``, ``pipeline``); with
  ``expected_uploads``, that many current parts (listings are strongly consistent, and
  two simultaneous committers race on a create-only write that exactly one wins), or
- explicitly by :meth:`RollUploader.commit`.

Either way only once the parts hold all that ROLL's resume reads (the pipeline's
state, every DCP shard each ``.metadata`` names: ``markers``), so a wrong count or a
wrong declaration never commits a checkpoint missing a shard. After the commit the
markers (and objects only a crashed earlier attempt wrote) are removed, so the prefix
holds exactly the manifest's objects. A checkpoint whose parts stop arriving is an
ERROR naming it and what is missing at the next save, at ``wait``/``close`` and at
process end (``openckpts``), and resume names each one it skips.

A bucket ``output_dir`` given to ROLL's own ``file_system`` type builds these
uploaders too (``bucketkey``), and ``doctor`` reads ROLL's launch before it runs.

Each checkpoint's upload stands alone: one that fails for good is logged as an
ERROR naming it and never stops a later one from committing (ROLL's manager
swallows uploader exceptions, so nothing else would tell).

``get_latest_ckpt`` downloads the highest committed ``checkpoint-N`` (torn ones
are invisible) and returns its local directory: ROLL hands that value to
``download_model``, which passes local directories through unchanged and sends
anything else to a model hub. ``cloudckpt roll upload|fetch`` uploads a local
checkpoint or fetches the latest one. See docs/integrations/roll.md.

The package: ``plugin`` (the declaration), ``binding`` (what activation binds into
ROLL's registries), ``commands`` (``cloudckpt roll ...``), ``layout`` (ROLL's names),
``resume`` (the latest committed checkpoint, downloaded), then ``worker`` (a worker's
local files and part name), ``markers`` (the part markers, and what ROLL's resume
needs of them), ``membership`` (which parts make a checkpoint), ``pipeline`` (ROLL's
pipeline object, read), ``uploader`` (the uploaders and the commit), ``openckpts``
(checkpoints not yet committed, reported), ``bucketkey`` (a bucket ``output_dir``
under ROLL's ``file_system`` type) and ``doctor`` (a launch, read).
"""

from cloudckpt.util.lazy import lazy_exports

__getattr__ = lazy_exports(__name__, {
    "binding": ("register", "wrap_model_downloaders"),
    "commands": ("upload_checkpoint", "uploader_for"),
    "layout": ("CKPT_RE", "PARTS_DIR"),
    "resume": ("download_checkpoint",),
    "uploader": (
        "DEFAULT_PARTS_TIMEOUT",
        "DEFAULT_TORN_GRACE_SECONDS",
        "GcsUploader",
        "RollUploader",
        "S3Uploader",
    ),
})

__all__ = [
    "CKPT_RE",
    "GcsUploader",
    "PARTS_DIR",
    "RollUploader",
    "S3Uploader",
    "download_checkpoint",
    "register",
    "upload_checkpoint",
    "uploader_for",
    "wrap_model_downloaders",
]
