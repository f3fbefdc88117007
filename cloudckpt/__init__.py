"""cloudckpt: crash-safe PyTorch checkpoints on object storage.

A checkpoint is a prefix of objects plus a manifest written last and
create-only: it is either complete and verifiable, or invisible.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from cloudckpt.core.checkpoint import Checkpoint, CheckpointWriter, open_checkpoint
from cloudckpt.core.deletion import delete_checkpoint
from cloudckpt.core.listing import CheckpointInfo, latest_checkpoint, list_checkpoints
from cloudckpt.core.manifest import MANIFEST_NAME, Manifest
from cloudckpt.errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CheckpointNotFoundError,
    CloudCkptError,
    CommitConflictError,
    ConfigError,
    CorruptCheckpointError,
    DeviceCopyError,
    DiskFullError,
    IncompleteCheckpointError,
    ManifestError,
    NotACheckpointError,
    PartialCheckpointError,
    StateMismatchError,
    StorageError,
    WorldSizeError,
)
from cloudckpt.storage import ObjectInfo, RetryPolicy, Store, open_store
from cloudckpt.util.lazy import lazy_exports

# Names that need torch load on first use, so that `cloudckpt ls` stays quick.
__getattr__ = lazy_exports(__name__, {
    "training.manager": ("CheckpointManager",),
    "training.options": ("ManagerOptions",),
    "training.tiers": ("LocalTier",),
    "runtime.preemption": ("Preemption",),
    "training.slot": ("RecoverSlot",),
    "runtime.state": ("StepInfo",),
})

try:  # written once, in pyproject.toml
    __version__ = _version("cloudckpt")
except PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"

__all__ = [
    "MANIFEST_NAME",
    "AccessDeniedError",
    "BucketNotFoundError",
    "Checkpoint",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointWriter",
    "CloudCkptError",
    "CommitConflictError",
    "ConfigError",
    "CorruptCheckpointError",
    "DeviceCopyError",
    "DiskFullError",
    "IncompleteCheckpointError",
    "LocalTier",
    "Manifest",
    "ManagerOptions",
    "ManifestError",
    "NotACheckpointError",
    "ObjectInfo",
    "PartialCheckpointError",
    "Preemption",
    "RecoverSlot",
    "RetryPolicy",
    "StateMismatchError",
    "StepInfo",
    "StorageError",
    "Store",
    "WorldSizeError",
    "delete_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "open_checkpoint",
    "open_store",
]
