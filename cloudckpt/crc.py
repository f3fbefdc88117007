"""CRC32C, the checksum that S3 and GCS both compute natively.

Values are carried as 8-digit lower-case hex strings, the form the manifest
stores.
"""

from __future__ import annotations

from typing import Any

import google_crc32c

__all__ = ["Crc32c", "crc32c_hex"]

Buffer = bytes | bytearray | memoryview


def _readonly(data: Buffer) -> Any:
    # The C extension refuses buffers that must be released (bytearray,
    # memoryview); a numpy view of the same memory is accepted, without a copy.
    if isinstance(data, bytes):
        return data
    if isinstance(data, memoryview) and not data.c_contiguous:
        return bytes(data)
    import numpy as np  # here: processes that only hash bytes never load it

    return np.frombuffer(data, dtype=np.uint8)


def crc32c_hex(data: Buffer) -> str:
    """Return the CRC32C of ``data`` as 8 hex digits."""
    return f"{google_crc32c.value(_readonly(data)):08x}"


class Crc32c:
    """Incremental CRC32C for streamed data; ``size`` counts the bytes seen."""

    __slots__ = ("_crc", "size")

    def __init__(self) -> None:
        self._crc = 0
        self.size = 0

    def update(self, data: Buffer) -> None:
        self._crc = google_crc32c.extend(self._crc, _readonly(data))
        self.size += len(data) if not isinstance(data, memoryview) else data.nbytes

    def hexdigest(self) -> str:
        return f"{self._crc:08x}"
