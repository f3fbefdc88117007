"""CRC32C, the checksum that S3 and GCS both compute natively.

Values are carried as 8-digit lower-case hex strings, the form the manifest
stores. :func:`crc32c_combine` joins the CRC32Cs of pieces into the CRC32C of
their concatenation without their bytes, so pieces fetched in parallel (or a
server's per-part checksums) can be checked against one whole-object value.
"""

from __future__ import annotations

import base64
import functools
from typing import Any

import google_crc32c

__all__ = ["Buffer", "Crc32c", "crc32c_b64", "crc32c_combine", "crc32c_from_b64",
           "crc32c_hex", "crc32c_value", "nbytes"]

Buffer = bytes | bytearray | memoryview


def nbytes(data: Buffer) -> int:
    """The size of a buffer in bytes (a memoryview's ``len`` counts its items)."""
    return data.nbytes if isinstance(data, memoryview) else len(data)


def _readonly(data: Buffer) -> Any:
    # The C extension refuses buffers that must be released (bytearray,
    # memoryview); a numpy view of the same memory is accepted, without a copy.
    if isinstance(data, bytes):
        return data
    if isinstance(data, memoryview) and not data.c_contiguous:
        return bytes(data)
    import numpy as np  # here: processes that only hash bytes never load it

    return np.frombuffer(data, dtype=np.uint8)


def crc32c_value(data: Buffer) -> int:
    """Return the CRC32C of ``data`` as an integer (what :meth:`Crc32c.append` takes)."""
    return int(google_crc32c.value(_readonly(data)))


def crc32c_hex(data: Buffer) -> str:
    """Return the CRC32C of ``data`` as 8 hex digits."""
    return f"{crc32c_value(data):08x}"


def crc32c_b64(crc_hex: str) -> str:
    """8 hex digits -> the base64 of the 4 big-endian bytes S3 and GCS headers carry."""
    return base64.b64encode(bytes.fromhex(crc_hex)).decode("ascii")


def crc32c_from_b64(b64: str) -> str:
    """A CRC32C as S3 and GCS give it (base64 of 4 bytes) -> 8 hex digits."""
    raw = base64.b64decode(b64, validate=True)
    if len(raw) != 4:
        raise ValueError(f"not a CRC32C: {b64!r}")
    return raw.hex()


class Crc32c:
    """Incremental CRC32C for streamed data; ``size`` counts the bytes seen."""

    __slots__ = ("_crc", "size")

    def __init__(self) -> None:
        self._crc = 0
        self.size = 0

    def update(self, data: Buffer) -> None:
        self._crc = google_crc32c.extend(self._crc, _readonly(data))
        self.size += nbytes(data)

    def hexdigest(self) -> str:
        return f"{self._crc:08x}"

    @property
    def value(self) -> int:
        return self._crc

    def append(self, crc: int, size: int) -> None:
        """Account for ``size`` bytes whose CRC32C is ``crc`` as if they had been
        passed to :meth:`update` (pieces checked elsewhere, joined here in order)."""
        self._crc = crc32c_combine(self._crc, crc, size)
        self.size += size

    def add(self, data: Buffer, crc: int | None = None) -> None:
        """:meth:`update` with ``data``, or, where its CRC32C ``crc`` is known already
        (computed once by whoever made the bytes), :meth:`append` it."""
        if crc is None:
            self.update(data)
        else:
            self.append(crc, nbytes(data))


# --- combining ---------------------------------------------------------------
# A CRC register is a polynomial over GF(2) of degree < 32, stored reflected: bit
# 31 - k holds the coefficient of x^k. For the standard CRC (initial value and
# final XOR both all ones) the CRC of A+B is crc(A) * x^(8 len(B)) + crc(B), modulo
# the CRC polynomial P: the all-ones terms cancel. So combining needs only
# multiplication modulo P and powers of x.

#: P without its x^32 term, reflected (Castagnoli: 0x1EDC6F41).
_POLY = 0x82F63B78
_ONE = 1 << 31  # the polynomial 1 (x^0)


def _times_x(a: int) -> int:
    """``a * x mod P``: a shift towards x^31; an x^32 that falls out is replaced
    by P's lower terms."""
    return (a >> 1) ^ _POLY if a & 1 else a >> 1


def _mulmod(a: int, b: int) -> int:
    """``a * b mod P``, by adding ``b * x^k`` for every term x^k of ``a``."""
    product = 0
    bit = _ONE
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        b = _times_x(b)
        bit >>= 1
    return product


# x^(8 * 2^k) mod P for k = 0..63, each the square of the one before.
_X8_POWERS = [1 << 23]  # x^8
for _ in range(63):
    _X8_POWERS.append(_mulmod(_X8_POWERS[-1], _X8_POWERS[-1]))


@functools.lru_cache(maxsize=1024)
def _x_to_8n(n: int) -> int:
    """``x^(8 n) mod P``: the shift that appending ``n`` bytes applies to a CRC
    (cached: the lengths combined recur, a model's tensors come in few sizes)."""
    result, k = _ONE, 0
    while n:
        if n & 1:
            result = _mulmod(result, _X8_POWERS[k])
        n >>= 1
        k += 1
    return result


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC32C of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)`` alone
    (integers, as :meth:`Crc32c.value` gives them)."""
    if len_b < 0 or len_b >= 1 << 64:
        raise ValueError(f"invalid length {len_b}")
    if len_b == 0:
        return crc_a
    return _mulmod(crc_a, _x_to_8n(len_b)) ^ crc_b
