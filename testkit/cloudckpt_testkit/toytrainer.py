"""A stand-in for a framework's trainer module, for the activation tests: it saves with
a class it imported by name, as AReaL's trainers do."""

from __future__ import annotations

from pathlib import Path


class Saver:
    """The framework's own saver: a local file."""

    by = "framework"

    def __init__(self, path: str) -> None:
        self.path = path

    def save(self, data: bytes) -> str:
        Path(self.path).write_bytes(data)
        return self.path


def train(path: str) -> str:
    """What the framework's trainer does: build its saver, save."""
    return Saver(path).save(b"state")
