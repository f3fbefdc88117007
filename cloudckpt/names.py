"""The object names cloudckpt reserves: the one home of every fixed name.

The bottom of the package: every layer (storage backends included) imports
these from here, never from the layer that uses them most.
"""

from __future__ import annotations

#: The manifest's fixed key inside every checkpoint prefix.
MANIFEST_NAME = "cloudckpt-manifest.json"
#: The claim of the writer saving into a prefix (cloudckpt.core.claim); hidden from listings.
CLAIM_NAME = ".cloudckpt-writer.json"
#: Prefix of the local backend's temporary files (renamed into place when complete).
TMP_PREFIX = ".cloudckpt-tmp-"
#: Suffix of the GCS backend's hidden upload parts (a suffix: lifecycle rules match it).
PART_SUFFIX = ".cloudckpt-part"
#: Name fragments of backends' bookkeeping objects, hidden from listings.
INTERNAL_MARKS = (TMP_PREFIX, PART_SUFFIX)
#: A recover slot's pointer (cloudckpt.core.slots).
SLOT_POINTER_NAME = "slot-pointer.json"
#: A training checkpoint's DCP part (cloudckpt.training.snapshot): a save's own
#: committed sub-checkpoint, below its claim.
MODEL_PART = "model"
#: A run root's record of which ranks (hosts) hold which local-tier steps
#: (cloudckpt.training.tiers); an object of the root itself, beside the checkpoints.
TIERS_RECORD = "cloudckpt-tiers.json"
#: A run root's index of its committed checkpoints (cloudckpt.core.rootindex): an object
#: of the root itself, a cache of the manifests below it that listings read first.
INDEX_NAME = "cloudckpt-index.json"
#: A run root's blob area (cloudckpt.core.blobs): the objects of incremental saves,
#: each named by the SHA-256 of its bytes, beside the checkpoints that reference them.
BLOB_AREA = "cloudckpt-blobs"
#: A checkpoint's writer areas: ``<prefix>/.cloudckpt-writers/<writer id>/<path>``. A save
#: that took a prefix over (or retries one) writes its objects there, under names no
#: other writer uses, so a taken-over writer still running cannot overwrite them.
WRITER_AREAS = ".cloudckpt-writers"
#: An indexed DCP checkpoint's index (cloudckpt.dcp.records): each tensor once.
DCP_INDEX_NAME = "cloudckpt-dcp-index.json"


def is_hidden(name: str) -> bool:
    """Whether a listing hides the object named ``name`` (a key or a path): writer
    claims and backends' bookkeeping objects."""
    base = name.rsplit("/", 1)[-1]
    return base == CLAIM_NAME or any(m in base for m in INTERNAL_MARKS)
