"""Answers asked once per key and process: what a store learns of its bucket (does
it keep versions, does it enforce conditional writes) costs a request, and the answer
does not change while a run lasts."""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T")

__all__ = ["OncePerKey"]


class OncePerKey(Generic[T]):
    """A thread-safe ``{key: answer}`` whose first answer per key stays."""

    def __init__(self) -> None:
        self._answers: dict[Hashable, T] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> T | None:
        """The answer kept for ``key``, or None."""
        with self._lock:
            return self._answers.get(key)

    def settle(self, key: Hashable, answer: T) -> tuple[T, bool]:
        """Keep ``answer`` for ``key`` unless one is kept already (a racer's); returns
        the answer kept, and whether it is this one (the first)."""
        with self._lock:
            if key in self._answers:
                return self._answers[key], False
            self._answers[key] = answer
            return answer, True

    def forget(self) -> None:
        """Drop every answer (tests)."""
        with self._lock:
            self._answers.clear()
