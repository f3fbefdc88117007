"""DCP's on-store names, and ``.metadata`` unpickled safely.

``.metadata`` is a pickle; it is unpickled with an allowlist of DCP's own types,
so nothing in a checkpoint can execute code when it is read.
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ..errors import CorruptCheckpointError

METADATA_NAME = ".metadata"
SUFFIX = ".distcp"
DCP_KIND = "dcp"


_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata`` and nothing else: no callable outside an allowlist."""

    def find_class(self, module: str, name: str) -> Any:
        if "." in name:  # protocol 4 resolves dotted names: "os.system" via a module's imports
            raise pickle.UnpicklingError(f"dotted global {module}.{name} is not allowed in "
                                         "DCP metadata")
        if module == "torch.distributed.checkpoint.metadata":
            # Only the classes the module defines, not what it imports (os, torch, ...).
            obj = getattr(sys.modules.get(module), name, None)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in DCP metadata")


def load_metadata(data: bytes, *, source: str = METADATA_NAME) -> Metadata:
    """Unpickle DCP metadata without executing anything outside DCP's own types."""
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - any failure means: do not trust it
        raise CorruptCheckpointError(
            f"{source} is not safe DCP metadata ({exc}); refusing to load it", {source: str(exc)}
        ) from None
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(f"{source} does not hold DCP Metadata", {source: "type"})
    return md
