"""Amazon S3 (and S3-compatible) backend over s3fs.

Conditional writes are native: create-only sends ``If-None-Match: *`` and
compare-and-swap sends ``If-Match: <ETag>``; the server refuses a lost race
with 412. Large streamed objects go up as multipart uploads whose parts are
sent in parallel and retried one by one.

Retries are ours alone (:mod:`cloudckpt.storage.retry`): botocore's and
s3fs's own retry loops are set to a single attempt unless the caller
configures them, so a failure is retried, logged and bounded in one place.
What botocore's errors mean is in :mod:`.errors`; the storage options s3fs
gets, and the masking of credentials in botocore's logs, in :mod:`.options`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import s3fs
from fsspec.asyn import sync

from cloudckpt.compat.s3fs_private import call_s3
from cloudckpt.errors import StorageError
from cloudckpt.storage import versioning
from cloudckpt.storage.backend import Backend, Host
from cloudckpt.storage.backends.s3 import errors as s3_errors
from cloudckpt.storage.backends.s3.copy import MIN_PART_SIZE, ServerCopy
from cloudckpt.storage.backends.s3.errors import error_code as _code
from cloudckpt.storage.backends.s3.options import (
    create_only_header,
    mask_credentials,
    presigned_gets_tls,
    s3fs_options,
    sends_checksums,
)
from cloudckpt.storage.fsspec_backend import FsspecBackend
from cloudckpt.storage.objects import ObjectInfo
from cloudckpt.storage.options import init_options
from cloudckpt.storage.retry import status_of
from cloudckpt.storage.transfer.bodies import PartBody, Pieces
from cloudckpt.storage.transfer.httpget import DirectGet
from cloudckpt.storage.transfer.parts import PartWriter
from cloudckpt.storage.transfer.ranges import StreamedRanges
from cloudckpt.storage.writers import RawWriter
from cloudckpt.util.crc import Buffer, crc32c_b64

log = logging.getLogger(__name__)

#: Stores (probe keys) that answered 400 to the CRC32C header: sent without it.
_CHECKSUM_REFUSED: set[tuple[str, ...]] = set()

#: How long a presigned GET's URL is valid (it is used at once).
_PRESIGNED_FOR = 900

class S3Backend(StreamedRanges, FsspecBackend):
    """Objects in an S3 bucket, below an optional key prefix."""

    protocols: ClassVar[tuple[str, ...]] = ("s3", "s3a")
    native_conditional_writes: ClassVar[bool] = True
    probe_stale_version: ClassVar[str | None] = '"00000000000000000000000000000000"'
    classify = staticmethod(s3_errors.classify)

    @classmethod
    def filesystem_options(cls) -> frozenset[str] | None:
        return init_options(s3fs.S3FileSystem) - {"loop", "asynchronous"}

    def _read_options(self, scheme: str, options: dict[str, Any]) -> dict[str, Any]:
        # The store's own create-only header (e.g. Alibaba OSS's
        # "x-oss-forbid-overwrite: true"), sent instead of If-None-Match: *.
        self.create_only_header = create_only_header(options.pop("create_only_header", None))
        return super()._read_options(scheme, options)

    def _filesystem(self, options: dict[str, Any]) -> s3fs.S3FileSystem:
        mask_credentials(options)
        fs = s3fs.S3FileSystem(**s3fs_options(options, self.max_concurrency))
        fs.retries = 1  # one attempt per s3fs call: retries are ours (see module doc)
        self._send_checksums = sends_checksums(options.get("config_kwargs") or {})
        self._tls = presigned_gets_tls(options, bool(fs.req_kw or fs.s3_additional_kwargs))
        self._read_timeout = float(fs.config_kwargs.get("read_timeout") or 60)
        return fs

    def _split(self, path: str) -> tuple[str, str]:
        bucket, _, key = path.partition("/")
        return bucket, key

    def request(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        """One call of the S3 API on the object at ``path`` (one try: the Store's policy
        retries), through s3fs's client."""
        bucket, key = self._split(path)
        return sync(self.fs.loop, call_s3, self.fs, method, Bucket=bucket, Key=key, **kw)

    def head(self, path: str) -> dict[str, Any] | None:
        # One HEAD: s3fs's info() follows a missing key with a listing (a "directory"?),
        # a second request for every existence check of a manifest or claim.
        self.fs.invalidate_cache(path)
        try:
            resp = self.request("head_object", path)
        except FileNotFoundError:
            return None
        return {"name": path, "type": "file", "size": int(resp.get("ContentLength") or 0),
                "ETag": resp.get("ETag"), "LastModified": resp.get("LastModified")}

    def put(self, path: str, data: Buffer | Pieces, **cond: str) -> str:
        # botocore takes bytes, bytearray or a file; views go as a file (no copy).
        body = PartBody(data) if isinstance(data, (memoryview, Pieces)) else data
        return self.request("put_object", path, Body=body, **cond)["ETag"]

    def put_checked(self, path: str, data: Buffer | Pieces, crc32c: str) -> str:
        # Send the CRC32C we already have: S3 verifies it against the bytes it
        # received (and keeps it), and botocore then skips hashing the body
        # again for its default CRC32 -- a full pass over the data saved.
        key = self.cache_key(path)
        if not self._send_checksums or key in _CHECKSUM_REFUSED:
            return self.put(path, data)
        try:
            return self.put(path, data, ChecksumCRC32C=crc32c_b64(crc32c))
        except OSError as exc:
            code = _code(exc) or ""
            if status_of(exc, self) != 400 or "Digest" in code or "Mismatch" in code:
                # A checksum that did not match is never dropped: the store's policy
                # sends the bytes again with it (a body damaged on the way).
                raise
            version = self.put(path, data)  # the store refuses the header, not the bytes
        if key not in _CHECKSUM_REFUSED:
            _CHECKSUM_REFUSED.add(key)
            log.warning("%s refuses the x-amz-checksum-crc32c header (HTTP 400: %s); writes "
                        "there go without it, and the CRC32C is kept in the manifest only "
                        "(checked on every read)", self.uri_of(self._split(path)[0]),
                        code or "no code")
        return version

    def get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        if start is None and end is None:
            # One GET. s3fs's cat_file sends a HEAD first to learn the size (and
            # splits objects over 50 MiB into ranged GETs): two requests per object.
            return self.get_versioned(path)[0]
        return super().get(path, start, end)

    def cache_key(self, root: str) -> tuple[str, ...]:
        # A store told to send its own create-only header is probed for that header.
        return (*super().cache_key(root), repr(self.create_only_header))

    def put_if_absent(self, path: str, data: Buffer) -> str:
        if self.create_only_header is not None:
            self._own_create_only_header()
        return self._conditional_put(path, data, IfNoneMatch="*")

    def _own_create_only_header(self) -> None:
        """Have the client send the configured header instead of ``If-None-Match: *``
        (a botocore hook on the client s3fs uses, registered once per client)."""
        client = sync(self.fs.loop, self.fs.set_session)
        name, value = self.create_only_header or ("", "")

        def swap(request: Any, **_: Any) -> None:
            if request.headers.get("If-None-Match") == "*":
                del request.headers["If-None-Match"]
                request.headers[name] = value

        client.meta.events.register("before-sign.s3.PutObject", swap,
                                    unique_id=f"cloudckpt-create-only-{name}")

    def put_if_match(self, path: str, data: Buffer, version: str) -> str:
        return self._conditional_put(path, data, IfMatch=version)

    def _conditional_put(self, path: str, data: Buffer, **cond: str) -> str:
        try:
            return self.put(path, data, **cond)
        except FileNotFoundError:
            if "IfMatch" in cond:  # the object vanished: the CAS lost
                raise FileExistsError(path) from None
            raise
        except OSError as exc:
            code = _code(exc)
            # 412 from S3's own headers; 409 from stores' own create-only headers
            # (OSS "FileAlreadyExists", IBM COS "ObjectAlreadyExists"). S3's own 409,
            # ConditionalRequestConflict (a race with another operation on the key,
            # nothing written), is no lost race: it is retried (errors.classify).
            if code in ("PreconditionFailed", "412", "FileAlreadyExists",
                        "ObjectAlreadyExists", "409"):
                raise FileExistsError(path) from exc
            raise

    def get_versioned(self, path: str) -> tuple[bytes, str]:
        async def read() -> tuple[bytes, str]:
            bucket, key = self._split(path)
            resp = await call_s3(self.fs, "get_object", Bucket=bucket, Key=key)
            async with resp["Body"] as body:
                return await body.read(), resp["ETag"]

        return sync(self.fs.loop, read)

    def version_of(self, info: Mapping[str, Any]) -> str | None:
        return info.get("ETag")

    def bucket_exists(self, root: str) -> bool | None:
        try:
            sync(self.fs.loop, call_s3, self.fs, "head_bucket", Bucket=self._split(root)[0])
        except FileNotFoundError:
            return False
        return True

    def bucket_versioning(self, root: str) -> str:
        # GetBucketVersioning: no Status at all on a bucket that never had versioning.
        resp = sync(self.fs.loop, call_s3, self.fs, "get_bucket_versioning",
                    Bucket=self._split(root)[0])
        return {"Enabled": versioning.ENABLED, "Suspended": versioning.SUSPENDED}.get(
            resp.get("Status"), versioning.OFF)

    def delete(self, paths: list[str], root: str) -> None:
        # DeleteObjects with literal keys: s3fs's rm() expands glob characters, so a
        # key like "exp[lr=0.1]/a.bin" would be taken for a pattern.
        by_bucket: dict[str, list[str]] = {}
        for p in paths:
            bucket, key = self._split(p)
            by_bucket.setdefault(bucket, []).append(key)
        for bucket, keys in by_bucket.items():
            for i in range(0, len(keys), 1000):
                batch = [{"Key": k} for k in keys[i:i + 1000]]
                resp = sync(self.fs.loop, call_s3, self.fs, "delete_objects", Bucket=bucket,
                            Delete={"Objects": batch, "Quiet": True})
                errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
                if errors:
                    e = errors[0]
                    raise OSError(f"deleting s3://{bucket}/{e.get('Key')} failed: "
                                  f"{e.get('Code')} {e.get('Message', '')}".strip())
        for p in paths:
            self.fs.invalidate_cache(p)

    def open_writer(self, path: str, host: Host) -> RawWriter:
        return _MultipartWriter(self, host, path)

    # ------------------------------------------------ ranges, server-side copy

    #: Objects above this size are copied server-side as UploadPartCopy parts in
    #: parallel; smaller ones by one CopyObject (limit 5 GiB), whose speed is one
    #: request's. Set on a store's backend (``store.backend``) to tune.
    copy_part_threshold: int = 512 * 1024 * 1024

    async def open_range(self, path: str, start: int, end: int
                         ) -> tuple[Any, Callable[[], None]]:
        bucket, key = self._split(path)
        resp = await call_s3(self.fs, "get_object", Bucket=bucket, Key=key,
                                      Range=f"bytes={start}-{end - 1}")
        body = resp["Body"]
        if int(resp.get("ContentLength") or 0) > end - start:
            body.close()
            raise StorageError(f"s3://{path}: the server ignored the byte range "
                               f"[{start}, {end}) and sent {resp.get('ContentLength')} bytes")
        # aiobotocore's body joins the pieces buffered on each read; the response's own
        # stream hands them over as they came.
        stream = getattr(getattr(body, "raw_stream", None), "content", None)
        return (stream if hasattr(stream, "readany") else body), body.close

    async def direct_get(self, path: str) -> DirectGet | None:
        # A presigned GET, where it carries all botocore would send (see s3_options).
        if self._tls is None:
            return None
        bucket, key = self._split(path)
        await self.fs.set_session()
        s3 = await self.fs.get_s3(bucket)
        url = await s3.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=_PRESIGNED_FOR)
        return DirectGet(url, context=self._tls() if url.startswith("https:") else None,
                         timeout=self._read_timeout)

    def can_copy_from(self, other: Backend) -> bool:
        # CopyObject reads the source with the destination's credentials: only on one
        # endpoint with the same ones is that sure to work.
        return self.same_service(other)

    def copy(self, src_path: str, path: str, size: int, host: Host) -> ObjectInfo:
        return ServerCopy(self, host, src_path, path, size).run()


class _MultipartWriter(PartWriter):
    """An S3 multipart upload: parts of ``part_size`` (at least 5 MiB) in parallel.
    The part goes up as a file (:class:`PartBody`), which aiohttp reads in chunks.

    A small object goes up as one PUT with its CRC32C, which S3 verifies.
    """

    def __init__(self, backend: S3Backend, host: Host, path: str) -> None:
        super().__init__(backend, host, path, max(host.part_size, MIN_PART_SIZE))
        self._s3backend = backend
        self._upload_id: str | None = None

    def _start(self) -> None:
        self._upload_id = self._s3backend.request("create_multipart_upload", self._path)["UploadId"]

    def _upload(self, number: int, part: memoryview | Pieces) -> dict[str, Any]:
        resp = self._s3backend.request("upload_part", self._path, UploadId=self._upload_id,
                                 PartNumber=number, Body=PartBody(part))
        return {"PartNumber": number, "ETag": resp["ETag"]}

    def _finish(self, tokens: list[Any], size: int, crc32c: str) -> None:
        try:
            self._s3backend.request("complete_multipart_upload", self._path,
                              UploadId=self._upload_id, MultipartUpload={"Parts": tokens})
        except Exception as exc:
            # A completion the server applied but whose response was lost: the retry
            # finds the upload gone. The object is ours if its ETag is the one S3
            # derives from our parts' ETags.
            if _code(exc) != "NoSuchUpload" or not self._is_ours(tokens, size):
                raise
            log.info("completing the upload of s3://%s: the server had completed it and "
                     "its answer was lost; the object there is the one our parts make",
                     self._path)

    def _is_ours(self, tokens: list[Any], size: int) -> bool:
        """Whether the object is the one our parts make (its ETag is the MD5 of their
        MD5s; with SSE-KMS ETags are not MD5s, and this says no: the safe answer)."""
        try:
            backend = self._s3backend
            head = self._store.retry.call(lambda: backend.request("head_object", self._path),
                                          op="head", key=self._path, errors=backend)
            digest = hashlib.md5(b"".join(bytes.fromhex(t["ETag"].strip('"')) for t in tokens),
                                 usedforsecurity=False).hexdigest()
        except Exception:  # noqa: BLE001 - then the original error stands
            return False
        return (head.get("ContentLength") == size
                and head.get("ETag", "").strip('"') == f"{digest}-{len(tokens)}")

    def _single(self, data: memoryview | Pieces, size: int, crc32c: str) -> None:
        self._s3backend.put_checked(self._path, data, crc32c)

    def _abort_upload(self, store: Host) -> None:
        if self._upload_id is not None:
            self._s3backend.request("abort_multipart_upload", self._path, UploadId=self._upload_id)
            self._upload_id = None
