"""Recover slots: one fixed URI, overwritten by every save, never torn.

The commit protocol of a slot (its pointer, generations and swap); saving and
loading training state into one is :class:`cloudckpt.training.slot.RecoverSlot`.

A slot holds generations (``<slot>/gen-<time>-<id>/``, each a committed
training checkpoint) and a small pointer object (``<slot>/slot-pointer.json``)
naming the current one. A save writes a fresh generation, commits it, then
swaps the pointer by compare-and-swap (S3 ``If-Match``, GCS
``ifGenerationMatch``, local flock + rename); only after the swap is the
previous generation deleted. A crash at any instant leaves the pointer on a
complete generation; a writer that loses the swap removes its own generation
and raises :class:`~cloudckpt.errors.CommitConflictError`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from cloudckpt.core.checkpoint import Checkpoint, open_checkpoint
from cloudckpt.core.deletion import delete_checkpoint
from cloudckpt.errors import CheckpointNotFoundError, CommitConflictError, CorruptCheckpointError
from cloudckpt.names import SLOT_POINTER_NAME
from cloudckpt.runtime import coordination as coord
from cloudckpt.storage import Store, as_store

log = logging.getLogger(__name__)

POINTER = SLOT_POINTER_NAME
GENERATION_RE = re.compile(r"^gen-\d{20}-[0-9a-f]{8}$")


class Slot:
    """A fixed URI whose current generation is swapped in by compare-and-swap,
    keeping the last good one until the new one is committed.

    Call :meth:`commit` on every rank of a distributed job; rank 0 of
    ``process_group`` swaps the pointer.
    """

    def __init__(self, uri: str | Store, *, storage_options: Mapping[str, Any] | None = None,
                 process_group: Any = None) -> None:
        self.store = as_store(uri, storage_options)
        self.group = process_group

    @property
    def uri(self) -> str:
        return self.store.uri

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    # ---------------------------------------------------------------- pointer

    def _read_pointer(self) -> tuple[dict[str, Any] | None, str | None]:
        try:
            data, version = self.store.get_with_version(POINTER)
        except FileNotFoundError:
            return None, None
        try:
            doc = json.loads(data)
            ok = isinstance(doc, dict) and GENERATION_RE.match(str(doc.get("generation", "")))
        except ValueError:
            ok = False
        if not ok:
            raise CorruptCheckpointError(
                f"{self.store.key_uri(POINTER)} is not a valid slot pointer; the slot cannot "
                "be trusted. Inspect it with `cloudckpt ls` and delete the slot to start over.",
                {POINTER: "malformed"})
        return doc, version

    def exists(self) -> bool:
        """True when the slot holds a committed generation."""
        return self._read_pointer()[0] is not None

    def info(self) -> dict[str, Any] | None:
        """The current generation's pointer record (generation, step, step info, time)."""
        return self._read_pointer()[0]

    def generations(self) -> list[str]:
        """Every generation prefix present, committed or not (normally one)."""
        return [p for p in self.store.list_prefixes() if GENERATION_RE.match(p)]

    def commit(self, write: Callable[[Store], Any], *, step: int | None = None,
               step_info: Any = None) -> str:
        """Make a new generation current: ``write(generation_store)`` (called on every
        rank) must commit a checkpoint there; then the pointer swaps. Returns its name.

        The hook for writers other than :meth:`save`, e.g. files a framework's engine
        wrote (:func:`cloudckpt.training.staging.upload_dir`).
        """
        def begin() -> tuple[str, dict[str, Any] | None, str | None]:
            pointer, version = self._read_pointer()
            return f"gen-{time.time_ns():020d}-{uuid.uuid4().hex[:8]}", pointer, version

        begun = coord.on_coordinator(begin, self.group)
        assert begun is not None
        generation, pointer, version = begun
        write(self.store.child(generation))
        coord.on_coordinator(lambda: self._swap(generation, pointer, version, step, step_info),
                             self.group)
        return generation

    def current(self) -> Checkpoint:
        """The current generation, opened (its manifest read and checked)."""
        return open_checkpoint(self._current_store())

    def _current_store(self) -> Store:
        pointer, _ = self._read_pointer()
        if pointer is None:
            raise CheckpointNotFoundError(
                f"recover slot {self.uri} is empty: nothing was ever committed to it")
        return self.store.child(pointer["generation"])

    def _swap(self, generation: str, old: dict[str, Any] | None, version: str | None,
              step: int | None, step_info: Any) -> None:
        record = {"generation": generation, "step": step, "created": time.time(),
                  "step_info": _step_info_dict(step_info)}
        data = json.dumps(record, indent=1).encode()
        try:
            if version is None:
                self.store.put_if_absent(POINTER, data)
            else:
                self.store.put_if_match(POINTER, data, version)
        except CommitConflictError:
            log.warning("lost the pointer swap of slot %s; removing generation %s",
                        self.uri, generation)
            self._drop(generation)
            raise CommitConflictError(
                f"another writer saved into recover slot {self.uri} while this save ran; its "
                f"generation is current, this one ({generation}) was removed. Only one job "
                "should write a slot.") from None
        log.info("slot %s now at %s (step %s)", self.uri, generation, step)
        if old is not None:
            self._drop(old["generation"])

    def _drop(self, generation: str) -> None:
        try:
            delete_checkpoint(self.store.child(generation), force=True)
        except CheckpointNotFoundError:
            pass


def _step_info_dict(step_info: Any) -> dict[str, Any] | None:
    """A step-info dataclass (cloudckpt's or AReaL's), or a mapping, as a dict."""
    if step_info is None:
        return None
    if isinstance(step_info, Mapping):
        return dict(step_info)
    return dataclasses.asdict(step_info)
