"""What one part's upload sends: each file under its key, or, incremental, as a blob
of the output directory's area (held, and sent only when its bytes are new)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cloudckpt.core.blobs import BlobArea
from cloudckpt.storage import Store


def send_files(store: Store, files: Mapping[str, Path], area: BlobArea | None
               ) -> dict[str, dict[str, Any]]:
    """Send ``files`` (key -> local path) into the checkpoint at ``store``; the part
    marker's entries: each key's size and CRC32C, and its blob with ``area``."""
    if area is None:
        def put(key: str) -> dict[str, Any]:
            info = store.put_file(key, files[key])
            return {"size": info.size, "crc32c": info.crc32c}

        return dict(zip(sorted(files), store.map(put, sorted(files)), strict=True))
    sent = area.put_files(store, files)
    return {key: {"size": e.size, "crc32c": e.crc32c, "blob": e.blob}
            for key, e in sent.items()}
