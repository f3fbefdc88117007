"""When to save: :class:`SaveSchedule`, and the manager's schedules saved as one state."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from cloudckpt.runtime import coordination as coord


class SaveSchedule:
    """Fires when any of its counters (epochs, steps, seconds) reaches its period.

    Each call advances all three; the answer is their OR; a counter restarts
    only when it fires. Elapsed time is the MAX across ranks, so every rank
    decides alike. Its state is saved with each checkpoint and restored.
    """

    def __init__(self, every_steps: int | None = None, every_epochs: int | None = None,
                 every_seconds: float | None = None, group: Any = None) -> None:
        self.every_steps, self.every_epochs, self.every_seconds = (every_steps, every_epochs,
                                                                   every_seconds)
        self.group = group
        self.steps = 0
        self.epochs = 0
        self._start = time.monotonic()

    def check(self, *, steps: int = 1, epochs: int = 0) -> bool:
        self.steps += steps
        self.epochs += epochs
        fired = False
        if self.every_steps and self.steps >= self.every_steps:
            self.steps, fired = 0, True
        if self.every_epochs and self.epochs >= self.every_epochs:
            self.epochs, fired = 0, True
        if self.every_seconds:
            elapsed = coord.all_reduce_max(time.monotonic() - self._start, self.group)
            if elapsed >= self.every_seconds:
                self._start, fired = time.monotonic(), True
        return fired

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "epochs": self.epochs,
                "elapsed": time.monotonic() - self._start}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.steps, self.epochs = int(state["steps"]), int(state["epochs"])
        self._start = time.monotonic() - float(state["elapsed"])


class Schedules:
    """The manager's schedules, saved as one state: the bucket's, the local
    tier's with its count of local saves (which decides the drains), and the
    ``weights`` saves'."""

    def __init__(self, bucket: SaveSchedule, local: SaveSchedule | None,
                 weights: SaveSchedule | None = None) -> None:
        self.bucket, self.local, self.local_saves = bucket, local, 0
        self.weights = weights

    def state_dict(self) -> dict[str, Any]:
        out = self.bucket.state_dict()
        if self.local is not None:
            out["local"] = {**self.local.state_dict(), "saves": self.local_saves}
        if self.weights is not None:
            out["weights"] = self.weights.state_dict()
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.bucket.load_state_dict(state)
        if self.local is not None and "local" in state:
            self.local.load_state_dict(state["local"])
            self.local_saves = int(state["local"]["saves"])
        if self.weights is not None and "weights" in state:
            self.weights.load_state_dict(state["weights"])
