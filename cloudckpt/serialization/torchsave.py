"""``torch.save`` of a DCP item, in torch's own format, without the zip CRC32s.

torch computes a CRC32 of every record it writes, in one call that holds the GIL:
60 ms per 256 MiB, the largest share of a DCP save's client CPU, and time in which
no other thread of the save can send. Every item here has its CRC32C in the
manifest, checked on every read, so the zip's is redundant. ``torch.load`` reads
such records (torch documents it with ``torch.serialization.set_crc32_options``);
only a zip tool would call their CRCs wrong.

This drives torch's writer itself rather than flipping that process-wide option,
which would also drop the CRC32 of every ``torch.save`` another thread runs
meanwhile. Where torch's pieces are not the ones this was tested with, it is plain
``torch.save``.
"""

from __future__ import annotations

import inspect
import pickle
from typing import IO, Any

import torch
import torch.serialization as _ts

_SAVE_PARAMS = ["obj", "zip_file", "pickle_module", "pickle_protocol",
                "_disable_byteorder_record"]


def _writer_without_crc() -> bool:
    try:
        params = list(inspect.signature(_ts._save).parameters)
        return params == _SAVE_PARAMS and callable(_ts._get_storage_alignment)
    except (AttributeError, TypeError, ValueError):
        return False


_direct = _writer_without_crc()


def save_item(obj: Any, out: IO[bytes]) -> None:
    """Write ``obj`` to ``out`` as ``torch.save`` does, less the records' CRC32."""
    global _direct
    if _direct:
        try:
            writer = torch._C.PyTorchFileWriter(out, False, _ts._get_storage_alignment())
        except TypeError:  # another constructor: torch's own path from now on
            _direct = False
        else:
            _ts._save(obj, writer, pickle, _ts.DEFAULT_PROTOCOL, False)
            writer.write_end_of_file()
            return
    torch.save(obj, out)
