"""moto's S3 server with conditional writes made atomic, and upload checksums verified,
as S3's are.

moto checks ``If-None-Match: *`` and ``If-Match`` and only later stores the object,
so two racing create-only writes can both succeed when the machine is busy: a race
real S3 never loses. Requests carrying a condition are serialised here (the check
and the write happen under one lock); every other request runs as moto runs it.

moto also stores whatever ``x-amz-checksum-crc32c`` (or ``-crc32``) a PutObject or
UploadPart carries, matching or not; S3 answers 400 ``BadDigest`` and stores
nothing. Here the body is checked against the header first, as S3 does.

    python -m cloudckpt_testkit.moto_atomic -H 127.0.0.1 -p PORT
"""

from __future__ import annotations

import base64
import functools
import threading
import zlib
from collections.abc import Callable
from typing import Any

import google_crc32c

_CONDITIONS = ("If-None-Match", "If-Match")
#: The checksum headers verified, and how each is computed from the body.
_CHECKSUMS: dict[str, tuple[str, Callable[[bytes], int]]] = {
    "x-amz-checksum-crc32c": ("CRC32C", google_crc32c.value),
    "x-amz-checksum-crc32": ("CRC32", zlib.crc32),
}


def _atomic(method: Any, lock: threading.Lock) -> Any:
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if any(self.headers.get(h) for h in _CONDITIONS):
            with lock:
                return method(self, *args, **kwargs)
        return method(self, *args, **kwargs)

    return wrapper


def _verified(method: Any) -> Any:
    """A PUT carrying a body (not a copy) whose checksum header disagrees with the body
    is refused before moto sees it."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if "x-amz-copy-source" not in self.headers:
            for header, (name, compute) in _CHECKSUMS.items():
                sent = self.headers.get(header)
                body = self.body if isinstance(self.body, bytes) else b""
                if sent and sent != base64.b64encode(
                        compute(body).to_bytes(4, "big")).decode():
                    from moto.s3.exceptions import S3ClientError

                    raise S3ClientError(
                        "BadDigest", f"The {name} you specified did not match the "
                        "calculated checksum.")
        return method(self, *args, **kwargs)

    return wrapper


def patch() -> None:
    """Serialise moto's conditional PUTs and multipart completions; verify checksums."""
    from moto.s3.responses import S3Response

    lock = threading.Lock()
    for name in ("_key_response_put", "_key_response_post"):
        setattr(S3Response, name, _atomic(getattr(S3Response, name), lock))
    S3Response._key_response_put = _verified(S3Response._key_response_put)


def main() -> None:
    from moto.server import main as moto_main

    patch()
    moto_main()


if __name__ == "__main__":
    main()
