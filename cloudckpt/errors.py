"""Exceptions raised by cloudckpt.

Every message says what is wrong and what to do about it. All derive from
:class:`CloudCkptError`, so ``except CloudCkptError`` catches everything the
library raises on purpose.
"""

from __future__ import annotations


class CloudCkptError(Exception):
    """Base class of every error cloudckpt raises on purpose."""


class CheckpointNotFoundError(CloudCkptError, FileNotFoundError):
    """Nothing is stored at the URI (no manifest and no objects)."""


class IncompleteCheckpointError(CloudCkptError):
    """Objects exist under the prefix but no manifest: a save that never committed."""


class CorruptCheckpointError(CloudCkptError):
    """An object is missing, short, or fails its CRC32C check.

    ``problems`` maps each bad object's path to what is wrong with it.
    """

    def __init__(self, message: str, problems: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.problems: dict[str, str] = dict(problems or {})


class CommitConflictError(CloudCkptError):
    """A conditional write lost: the manifest exists already, or a CAS token is stale."""


class StorageError(CloudCkptError):
    """A storage operation failed permanently (or ran out of retries); ``__cause__`` has why."""


class DeviceCopyError(CloudCkptError):
    """A copy of tensor bytes between a device (GPU) and host memory failed: the copy
    itself, or the device reporting it (its event); ``__cause__`` has the device's error."""


class ConfigError(CloudCkptError, ValueError):
    """A URI, option or configuration value is invalid."""


class UntestedVersionError(ConfigError, ImportError):
    """Activation met a framework version (or source) its integration was not tested
    with, and refused to bind into it; the message names the tested ones."""


class ManifestError(CorruptCheckpointError):
    """A manifest is malformed or names a path that is not allowed."""


class NotACheckpointError(CheckpointNotFoundError):
    """The URI holds data but no checkpoint cloudckpt can act on: a root holding
    committed checkpoints below it, or objects cloudckpt did not write."""


class BucketNotFoundError(StorageError):
    """The bucket (or container) named in the URI does not exist."""


class AccessDeniedError(StorageError):
    """No credentials were found, or the store (or the Hub) refused the ones given."""


class DiskFullError(StorageError):
    """A local write failed for lack of space, a quota or the file size limit."""


class StateMismatchError(ConfigError):
    """The state to load into does not match the checkpoint (a key's shape or dtype)."""


class WorldSizeError(StateMismatchError):
    """Per-rank state was saved by a different number of ranks than are loading it."""


class PartialCheckpointError(StateMismatchError):
    """The checkpoint was saved with a profile that lacks state the resume asks for
    (a ``weights`` or ``adapters`` save holds no optimizer state); allow a partial
    resume to load what it holds and start the rest fresh."""


class OutsideRootError(StorageError, CorruptCheckpointError, PermissionError):
    """A path below a local store's root leads outside it through a symbolic link.

    Also a :class:`~cloudckpt.errors.CorruptCheckpointError`: a checkpoint holding
    such a link cannot be trusted, and listings, ``latest`` and resume skip it (or fall
    back) as they do any corrupt checkpoint instead of failing the whole root.
    """


# ---------------------------------------------------------------- exit codes
# What the command line (``cloudckpt``, and each integration's ``python -m`` command)
# exits with: one code per kind of failure (docs/cli.md lists them).

EXIT_OK, EXIT_CORRUPT, EXIT_USAGE, EXIT_NOT_FOUND = 0, 1, 2, 3
EXIT_INCOMPLETE, EXIT_CONFLICT, EXIT_STORAGE = 4, 5, 6
EXIT_ACCESS, EXIT_DISK_FULL, EXIT_INTERNAL = 7, 8, 70
EXIT_INTERRUPTED, EXIT_PIPE = 130, 141

#: Error class -> exit code; the first match wins, so subclasses come first.
EXIT_CODES: list[tuple[type[BaseException], int]] = [
    (DiskFullError, EXIT_DISK_FULL),
    (AccessDeniedError, EXIT_ACCESS),
    (BucketNotFoundError, EXIT_NOT_FOUND),
    (CorruptCheckpointError, EXIT_CORRUPT),
    (ConfigError, EXIT_USAGE),
    (NotACheckpointError, EXIT_USAGE),
    (CheckpointNotFoundError, EXIT_NOT_FOUND),
    (IncompleteCheckpointError, EXIT_INCOMPLETE),
    (CommitConflictError, EXIT_CONFLICT),
    (StorageError, EXIT_STORAGE),
]


def exit_code(exc: BaseException) -> int:
    """The command's exit code for ``exc`` (storage failures by default)."""
    for cls, code in EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return EXIT_STORAGE
