"""An allow-list unpickler, for plain pickles that other programs write.

The caller names every global the pickle may use and what each resolves to;
anything else is refused, so reading such a file cannot execute code.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from typing import IO, Any

from cloudckpt.compat import torch_private
from cloudckpt.serialization.torchload import load_storage_bytes

#: The globals plain ``pickle`` writes for a CPU tensor, resolved to loaders that
#: accept tensors only (its storage goes through ``weights_only``).
TENSOR_GLOBALS: Mapping[tuple[str, str], Any] = {
    torch_private.REBUILD_TENSOR_V2: torch_private.rebuild_tensor_v2,
    torch_private.LOAD_FROM_BYTES: load_storage_bytes,
}


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the ``(module, name)`` globals in ``allowed`` (to the object it
    maps them to); any other global raises :class:`pickle.UnpicklingError` saying it
    is not allowed in ``what``."""

    def __init__(self, file: IO[bytes], allowed: Mapping[tuple[str, str], Any],
                 what: str = "this pickle") -> None:
        super().__init__(file)
        self._allowed = allowed
        self._what = what

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"{module}.{name} is not allowed in {self._what}") from None


def restricted_loads(data: bytes, allowed: Mapping[tuple[str, str], Any],
                     what: str = "this pickle") -> Any:
    """``pickle.loads(data)`` through a :class:`RestrictedUnpickler`."""
    return RestrictedUnpickler(io.BytesIO(data), allowed, what).load()
