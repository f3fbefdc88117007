"""Hugging Face exports: safetensors writing and reading (:mod:`.exporting`),
DCP-to-HF conversion (:mod:`.convert`) and Hub uploads (:mod:`.hub`).

The export functions load torch on first use, so that ``cloudckpt.hf.hub``
(used by the CLI) stays quick to import.
"""

from __future__ import annotations

from cloudckpt.util.lazy import lazy_exports

__all__ = ["download", "export", "from_pretrained", "load_state_dict", "parse_size"]
__getattr__ = lazy_exports(__name__, {
    "exporting": (*__all__, "KIND", "cache_dir", "weight_files")})
