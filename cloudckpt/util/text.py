"""Words in messages: one home for the plural every message and command prints."""

from __future__ import annotations


def plural(n: int, word: str) -> str:
    """``1 rank``, ``2 ranks``."""
    return f"{n} {word}{'' if n == 1 else 's'}"
