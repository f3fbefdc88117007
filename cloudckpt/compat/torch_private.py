"""torch's private internals: DCP's storage record and state-dict helpers, the pieces
of ``torch.save``'s writer, and the private names torch's own pickles refer to.

DCP's modules load only when asked (``StorageInfo``, the state-dict helpers): they add
seconds to an import of torch, which the serialization modules do not need.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
from collections.abc import Mapping
from typing import IO, Any

import torch
import torch.serialization

from cloudckpt.compat import Internal

_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
_NESTED = "torch.distributed.checkpoint._nested_dict"
_STATE_DICT_UTILS = "torch.distributed._state_dict_utils"

#: The globals torch's pickles name, as ``(module, name)``: a tensor in a plain pickle
#: (``_rebuild_tensor_v2``; ``_v3`` where the dtype is recorded apart), a storage in
#: one (``_load_from_bytes``), a layout and DCP's storage record in DCP's ``.metadata``.
REBUILD_TENSOR_V2 = ("torch._utils", "_rebuild_tensor_v2")
REBUILD_TENSOR_V3 = ("torch._utils", "_rebuild_tensor_v3")
LOAD_FROM_BYTES = ("torch.storage", "_load_from_bytes")
GET_LAYOUT = ("torch.serialization", "_get_layout")
STORAGE_INFO = (_FILESYSTEM, "_StorageInfo")

#: The parameters of ``torch.serialization._save`` that :func:`save_without_crc` was
#: written for; with any others it leaves the work to ``torch.save``.
_SAVE_PARAMS = ["obj", "zip_file", "pickle_module", "pickle_protocol",
                "_disable_byteorder_record"]

INTERNALS = {
    f"{_FILESYSTEM}._StorageInfo": Internal(
        "where each DCP item lies in its file: our writer's results subclass it and our "
        "reader's metadata holds it, as torch's FileSystemReader expects"),
    f"{_NESTED}.flatten_state_dict": Internal(
        "DCP's own flattening of a nested state, so that staging and the save-time checks "
        "see the keys DCP will write"),
    f"{_NESTED}.unflatten_state_dict": Internal("puts a staged flat state back as it was"),
    f"{_STATE_DICT_UTILS}._create_cpu_state_dict": Internal(
        "host buffers (pinned for GPU tensors) in a state's layout, kept between saves"),
    f"{_STATE_DICT_UTILS}._copy_state_dict": Internal(
        "copies a state into those buffers, non-blocking from a GPU"),
    "torch._utils._element_size": Internal("bytes per element of a dtype in a write plan"),
    "torch._utils._rebuild_tensor_v2": Internal(
        "the loader a plain pickle of a tensor names; allowed in restricted unpicklers"),
    "torch._utils._rebuild_tensor_v3": Internal(
        "the other tensor loader torch's pickles may name; described, never called"),
    "torch.storage._load_from_bytes": Internal(
        "the name a plain pickle of a storage gives; we load its bytes ourselves"),
    "torch.serialization._get_layout": Internal("a layout named in DCP's .metadata"),
    "torch.serialization._save": Internal(
        "torch.save's writer, driven without its zip CRC32s (every item has a CRC32C "
        "in the manifest); its parameters are checked before use"),
    "torch.serialization._get_storage_alignment": Internal(
        "the alignment torch.save gives storages, for that same writer"),
    "torch._C.PyTorchFileWriter": Internal(
        "the zip writer torch.save uses, made with its CRC32s turned off"),
}


def __getattr__(name: str) -> Any:
    if name == "StorageInfo":
        return _storage_info()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _storage_info() -> type:
    """``torch.distributed.checkpoint.filesystem._StorageInfo``: DCP's record of an
    item's file, offset and length, which ``.metadata`` holds for every item."""
    return importlib.import_module(_FILESYSTEM)._StorageInfo


def flatten_state_dict(state: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """``torch.distributed.checkpoint._nested_dict.flatten_state_dict``: a nested state
    as DCP flattens it, and the mapping back."""
    return importlib.import_module(_NESTED).flatten_state_dict(state)


def unflatten_state_dict(flat: Mapping[str, Any], mapping: Any) -> dict[str, Any]:
    """``torch.distributed.checkpoint._nested_dict.unflatten_state_dict``."""
    return importlib.import_module(_NESTED).unflatten_state_dict(flat, mapping)


def create_cpu_state_dict(state: Mapping[str, Any], pin_memory: bool) -> dict[str, Any]:
    """``torch.distributed._state_dict_utils._create_cpu_state_dict``: host tensors in
    ``state``'s layout (pinned for a copy from a GPU)."""
    return importlib.import_module(_STATE_DICT_UTILS)._create_cpu_state_dict(
        state, pin_memory=pin_memory)


def copy_state_dict(state: Mapping[str, Any], into: dict[str, Any],
                    non_blocking: bool) -> None:
    """``torch.distributed._state_dict_utils._copy_state_dict``: ``state``'s tensors
    copied into ``into``'s."""
    importlib.import_module(_STATE_DICT_UTILS)._copy_state_dict(
        state, into, non_blocking=non_blocking)


def element_size(dtype: torch.dtype) -> int:
    """``torch._utils._element_size``: bytes per element of ``dtype``."""
    return torch._utils._element_size(dtype)


#: ``torch._utils._rebuild_tensor_v2``, what :data:`REBUILD_TENSOR_V2` names.
rebuild_tensor_v2 = torch._utils._rebuild_tensor_v2


def _writer_fits() -> bool:
    try:
        params = list(inspect.signature(torch.serialization._save).parameters)
        return params == _SAVE_PARAMS and callable(torch.serialization._get_storage_alignment)
    except (AttributeError, TypeError, ValueError):
        return False


_direct = _writer_fits()


def save_without_crc(obj: Any, out: IO[bytes]) -> bool:
    """Write ``obj`` to ``out`` as ``torch.save`` does, less the records' CRC32, through
    ``torch.serialization._save`` and ``torch._C.PyTorchFileWriter``; return False,
    having written nothing, where those are not the pieces this was tested with (then
    ``torch.save`` is the way, from now on)."""
    global _direct
    if not _direct:
        return False
    try:
        writer = torch._C.PyTorchFileWriter(out, False,
                                            torch.serialization._get_storage_alignment())
    except TypeError:  # another constructor
        _direct = False
        return False
    torch.serialization._save(obj, writer, pickle, torch.serialization.DEFAULT_PROTOCOL,
                              False)
    writer.write_end_of_file()
    return True
