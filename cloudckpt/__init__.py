"""cloudckpt: crash-safe PyTorch checkpoints on object storage.

A checkpoint is a prefix of objects plus a manifest written last and
create-only: it is either complete and verifiable, or invisible.
"""

from .checkpoint import (
    Checkpoint,
    CheckpointInfo,
    CheckpointWriter,
    delete_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    open_checkpoint,
)
from .errors import (
    CheckpointNotFoundError,
    CloudCkptError,
    CommitConflictError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ManifestError,
    StorageError,
)
from .manifest import MANIFEST_NAME, Manifest
from .storage import ObjectInfo, RetryPolicy, Store, open_store

__version__ = "0.1.0"

__all__ = [
    "MANIFEST_NAME",
    "Checkpoint",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointWriter",
    "CloudCkptError",
    "CommitConflictError",
    "ConfigError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "Manifest",
    "ManifestError",
    "ObjectInfo",
    "RetryPolicy",
    "StorageError",
    "Store",
    "delete_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "open_checkpoint",
    "open_store",
]
