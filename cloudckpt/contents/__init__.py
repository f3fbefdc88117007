"""Looking inside committed checkpoints without downloading them: what they hold
(:mod:`.inventory`, from metadata alone) and how two differ (:mod:`.compare`)."""

from __future__ import annotations

from cloudckpt.util.lazy import lazy_exports

__all__ = ["Contents", "Diff", "Entry", "diff", "list_contents"]
__getattr__ = lazy_exports(__name__, {"inventory": ("Contents", "Entry", "list_contents"),
                                      "compare": ("Diff", "diff")})
