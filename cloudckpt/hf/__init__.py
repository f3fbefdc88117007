"""Hugging Face exports: safetensors writing and reading (:mod:`.exporting`), reading
some tensors of an export without the rest (:mod:`.lazy`), DCP-to-HF conversion
(:mod:`.convert`) and Hub uploads (:mod:`.hub`).

The export functions load torch on first use, so that ``cloudckpt.hf.hub``
(used by the CLI) stays quick to import.
"""

from __future__ import annotations

from cloudckpt.util.lazy import lazy_exports

__all__ = ["ExportReader", "download", "export", "from_pretrained", "load_state_dict",
           "load_tensors", "open_export", "parse_size"]
__getattr__ = lazy_exports(__name__, {
    "exporting": ("download", "export", "from_pretrained", "load_state_dict", "parse_size",
                  "KIND", "cache_dir", "weight_files"),
    "lazy": ("ExportReader", "load_tensors", "open_export")})
