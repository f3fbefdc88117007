"""The command's exit codes: one per kind of failure (docs/cli.md lists them)."""

from __future__ import annotations

from ..errors import (
    AccessDeniedError,
    BucketNotFoundError,
    CheckpointNotFoundError,
    CommitConflictError,
    ConfigError,
    CorruptCheckpointError,
    DiskFullError,
    IncompleteCheckpointError,
    NotACheckpointError,
    StorageError,
)

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
