"""What the Azure backend makes of its storage options: adlfs's, and its own
``transfer_checksum``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: What the service checks each request's body with (the ``transfer_checksum``
#: storage option): x-ms-content-crc64, Content-MD5, nothing. The manifest's
#: CRC32C is checked on every read whichever it is.
TRANSFER_CHECKS = ("crc64", "md5", "none")


def adlfs_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The storage options less the backend's own (kept in ``storage_options``, so
    that stores differing only there are told apart)."""
    return {k: v for k, v in options.items() if k != "transfer_checksum"}
