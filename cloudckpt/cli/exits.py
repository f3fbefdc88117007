"""The command's exit codes: one per kind of failure (docs/cli.md lists them). They
live in :mod:`cloudckpt.errors`, so the integrations' commands exit the same way."""

from __future__ import annotations

from ..errors import (  # noqa: F401 - re-exported: the command's interface
    EXIT_ACCESS,
    EXIT_CODES,
    EXIT_CONFLICT,
    EXIT_CORRUPT,
    EXIT_DISK_FULL,
    EXIT_INCOMPLETE,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_PIPE,
    EXIT_STORAGE,
    EXIT_USAGE,
    exit_code,
)
