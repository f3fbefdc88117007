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


class ConfigError(CloudCkptError, ValueError):
    """A URI, option or configuration value is invalid."""


class ManifestError(CorruptCheckpointError):
    """A manifest is malformed or names a path that is not allowed."""
