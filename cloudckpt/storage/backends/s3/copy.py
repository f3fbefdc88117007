"""Server-side copies on S3: one CopyObject, or a multipart upload of UploadPartCopy
parts in parallel, and what S3 says of the copy's CRC32C."""

from __future__ import annotations

import base64
from typing import Any

from cloudckpt.storage.backend import Host
from cloudckpt.storage.backends.s3.errors import error_code as _code
from cloudckpt.storage.objects import ObjectInfo
from cloudckpt.storage.retry import ONE_TRY
from cloudckpt.util.crc import Crc32c, crc32c_b64, crc32c_from_b64, crc32c_hex

#: S3 refuses parts smaller than this (except the last).
MIN_PART_SIZE = 5 * 1024 * 1024
#: The largest object one CopyObject copies, and the largest part.
MAX_COPY_OBJECT = 5 * 1024 * 1024 * 1024


class ServerCopy:
    """One object copied on the server: one CopyObject, or (above the store's
    ``copy_part_threshold``) a multipart upload of UploadPartCopy parts in
    parallel; then a HEAD for what S3 says of the result.

    Copies ask S3 for a CRC32C (``ChecksumAlgorithm``), computed from the bytes
    it wrote, and a multipart copy for a full-object one (``ChecksumType=
    FULL_OBJECT``). A composite checksum (``<crc>-<parts>``) is turned into the
    whole object's by combining the parts' CRC32Cs when UploadPartCopy gave them;
    otherwise the CRC32C is reported as unknown and the caller reads the copy back.
    """

    def __init__(self, backend: Any, host: Host, src_path: str, path: str,
                 size: int) -> None:
        self.backend = backend
        self.host = host
        self.path = path
        self.size = size
        bucket, key = backend._split(src_path)
        self.source = {"Bucket": bucket, "Key": key}
        self.checksum = {"ChecksumAlgorithm": "CRC32C"} if backend._send_checksums else {}

    def _retry(self, op: str, fn: Any) -> Any:
        return self.host.retry.call(fn, op=op, key=f"s3://{self.path}", errors=self.backend)

    def run(self) -> ObjectInfo:
        s3 = self.backend.request
        parts: list[tuple[str | None, int]] | None = None
        if self.size <= min(self.backend.copy_part_threshold, MAX_COPY_OBJECT):
            self._retry("copy", lambda: s3("copy_object", self.path, CopySource=self.source,
                                           **self.checksum))
        else:
            parts = self._copy_parts()
        mode = {"ChecksumMode": "ENABLED"} if self.checksum else {}
        head = self._retry("head", lambda: s3("head_object", self.path, **mode))
        return ObjectInfo(self.path, int(head.get("ContentLength", -1)),
                          whole_crc32c(head, parts), head.get("ETag"))

    def _copy_parts(self) -> list[tuple[str | None, int]]:
        store, s3 = self.host, self.backend.request
        # About one part per request in flight, within S3's limits: 5 MiB to 5 GiB
        # a part, 10,000 parts.
        part = max(store.part_size, MIN_PART_SIZE, -(-self.size // 10_000),
                   min(-(-self.size // store.max_concurrency), MAX_COPY_OBJECT))
        ranges = [(n + 1, s, min(s + part, self.size))
                  for n, s in enumerate(range(0, self.size, part))]
        kind = {"ChecksumType": "FULL_OBJECT"} if self.checksum else {}
        upload_id = self._retry("start copy", lambda: s3(
            "create_multipart_upload", self.path, **self.checksum, **kind))["UploadId"]

        def one(r: tuple[int, int, int]) -> tuple[dict[str, Any], int]:
            number, start, end = r
            resp = self._retry("copy part", lambda: s3(
                "upload_part_copy", self.path, UploadId=upload_id, PartNumber=number,
                CopySource=self.source, CopySourceRange=f"bytes={start}-{end - 1}"))
            result = resp.get("CopyPartResult", {})
            token = {"PartNumber": number, "ETag": result["ETag"]}
            if result.get("ChecksumCRC32C"):
                token["ChecksumCRC32C"] = result["ChecksumCRC32C"]
            return token, end - start

        attempts = 0

        def complete() -> None:
            nonlocal attempts
            attempts += 1
            try:
                s3("complete_multipart_upload", self.path, UploadId=upload_id,
                   MultipartUpload={"Parts": [t for t, _ in done]})
            except Exception as exc:
                # A completion applied whose response was lost: the retry finds the
                # upload gone. The HEAD and the caller's check judge what is there.
                if attempts == 1 or _code(exc) != "NoSuchUpload":
                    raise

        try:
            done = store.map(one, ranges)
            self._retry("finish copy", complete)
        except BaseException:
            try:
                ONE_TRY.call(lambda: s3("abort_multipart_upload", self.path,
                                         UploadId=upload_id),
                              op="abort copy", key=f"s3://{self.path}", errors=self.backend)
            except Exception:  # noqa: BLE001 - best effort; lifecycle rules clean up the rest
                pass
            raise
        return [(t.get("ChecksumCRC32C"), n) for t, n in done]


def whole_crc32c(head: dict[str, Any], parts: list[tuple[str | None, int]] | None
                  ) -> str | None:
    """The whole object's CRC32C (hex) from a HEAD, or None where S3 gave none: a
    full-object value as is; a composite one (the CRC32C of the parts' CRC32Cs,
    then ``-<parts>``) only when it is made of ``parts`` (their base64 CRC32Cs and
    sizes), whose CRC32Cs then combine into the whole's."""
    value, kind = head.get("ChecksumCRC32C"), head.get("ChecksumType")
    try:
        if not value:
            return None
        if kind != "COMPOSITE" and "-" not in value:
            return crc32c_from_b64(value)
        if not parts or any(c is None for c, _ in parts):
            return None
        crcs = [base64.b64decode(c or "", validate=True) for c, _ in parts]
        if any(len(c) != 4 for c in crcs):
            return None
        if value != f"{crc32c_b64(crc32c_hex(b''.join(crcs)))}-{len(parts)}":
            return None  # not the parts this copy made
        whole = Crc32c()
        for raw, (_, size) in zip(crcs, parts, strict=True):
            whole.append(int.from_bytes(raw, "big"), size)
        return whole.hexdigest()
    except ValueError:  # malformed base64 or length: no usable checksum
        return None
