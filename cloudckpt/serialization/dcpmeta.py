"""DCP's ``.metadata`` pickle, unpickled with an allow-list of DCP's own types.

A checkpoint's ``.metadata`` comes from the bucket, not from code we trust: only
the classes DCP's metadata module defines, dtypes and a few plain helpers may be
named in it, so reading it cannot execute code.
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any

import torch
import torch.distributed.checkpoint.metadata  # noqa: F401 - find_class looks in it

from cloudckpt.compat import torch_private

_ALLOWED_GLOBALS = {
    ("torch", "Size"),
    torch_private.GET_LAYOUT,
    torch_private.STORAGE_INFO,
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


def unpickle_metadata(data: bytes) -> Any:
    """The object ``.metadata`` holds; :class:`pickle.UnpicklingError` (or another
    error, for damaged bytes) for anything outside the allowlist."""
    return _MetadataUnpickler(io.BytesIO(data)).load()
