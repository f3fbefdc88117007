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

from typing import IO, Any

import torch

from cloudckpt.compat import torch_private


def save_item(obj: Any, out: IO[bytes]) -> None:
    """Write ``obj`` to ``out`` as ``torch.save`` does, less the records' CRC32."""
    if not save_item_unread(obj, out):
        torch.save(obj, out)


def save_item_unread(obj: Any, out: IO[bytes]) -> bool:
    """Write ``obj`` to ``out`` as :func:`save_item` does, passing each storage's bytes
    to ``out.write`` in one call without reading them (no CRC32 computed over them), so
    that ``out`` may send other bytes in their place; return False, having written
    nothing, where torch's writer would read them (``torch.save`` is the way then)."""
    return torch_private.save_without_crc(obj, out)
