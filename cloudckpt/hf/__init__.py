"""Hugging Face exports: safetensors writing and reading (:mod:`.exporting`),
DCP-to-HF conversion (:mod:`.convert`) and Hub uploads (:mod:`.hub`).

The export functions load torch on first use, so that ``cloudckpt.hf.hub``
(used by the CLI) stays quick to import.
"""

from __future__ import annotations

from typing import Any

__all__ = ["download", "export", "from_pretrained", "load_state_dict", "parse_size"]
_EXPORTING = {*__all__, "KIND", "cache_dir", "weight_files"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTING:
        from cloudckpt.hf import exporting

        return getattr(exporting, name)
    raise AttributeError(f"module 'cloudckpt.hf' has no attribute {name!r}")
