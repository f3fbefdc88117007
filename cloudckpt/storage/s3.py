"""Amazon S3 (and S3-compatible) backend over s3fs.

Conditional writes are native: create-only sends ``If-None-Match: *`` and
compare-and-swap sends ``If-Match: <ETag>``; the server refuses a lost race
with 412. Large streamed objects go up as multipart uploads whose parts are
sent in parallel and retried one by one.

Retries are ours alone (:mod:`cloudckpt.storage.retry`): botocore's and
s3fs's own retry loops are set to a single attempt unless the caller
configures them, so a failure is retried, logged and bounded in one place.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import logging
import os
import threading
from typing import Any, ClassVar

import s3fs
from fsspec.asyn import sync

from ..crc import Buffer
from .base import RawWriter, Store
from .parts import PartWriter
from .retry import mask_secrets

#: S3 refuses parts smaller than this (except the last).
MIN_PART_SIZE = 5 * 1024 * 1024

# botocore's DEBUG lines carry the session token (the request headers it sends and
# the canonical request it signs); these loggers get a filter that masks every
# credential an S3Store was given, so `cloudckpt -vv` output is safe to share.
_LEAKY_LOGGERS = ("botocore.auth", "botocore.endpoint", "aiobotocore.endpoint")
_secrets: tuple[str, ...] = ()  # replaced whole under the lock, read without it
_secrets_lock = threading.Lock()


class _MaskSecrets(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        secrets = _secrets
        if secrets:
            message = record.getMessage()
            masked = mask_secrets(message, secrets)
            if masked != message:
                record.msg, record.args = masked, None
        return True


_MASK = _MaskSecrets()


def _mask_credentials(options: dict[str, Any]) -> None:
    """Register the credentials in ``options`` (and the environment's) for masking."""
    global _secrets
    client = options.get("client_kwargs")
    client = client if isinstance(client, dict) else {}
    found = [options.get("secret"), options.get("token"),
             client.get("aws_secret_access_key"), client.get("aws_session_token"),
             os.environ.get("AWS_SECRET_ACCESS_KEY"), os.environ.get("AWS_SESSION_TOKEN")]
    new = {v for v in found if isinstance(v, str) and len(v) >= 8} - set(_secrets)
    if new:
        with _secrets_lock:
            if not _secrets:
                for name in _LEAKY_LOGGERS:
                    logging.getLogger(name).addFilter(_MASK)
            _secrets = (*_secrets, *new)


class S3Store(Store):
    """Objects in an S3 bucket, below an optional key prefix."""

    protocols: ClassVar[tuple[str, ...]] = ("s3", "s3a")
    native_conditional_writes: ClassVar[bool] = True

    def __init__(self, root: str, *, max_concurrency: int = 16, **kwargs: Any) -> None:
        options = dict(kwargs.pop("storage_options", None) or {})
        _mask_credentials(options)
        fs = s3fs.S3FileSystem(**_s3fs_options(options, max_concurrency))
        fs.retries = 1  # one attempt per s3fs call: retries are ours (see module doc)
        # For servers without flexible checksums, botocore's own switch turns ours off too.
        config = options.get("config_kwargs") or {}
        self._send_checksums = config.get("request_checksum_calculation") != "when_required"
        super().__init__(fs, root, protocol="s3", max_concurrency=max_concurrency,
                         storage_options=options, **kwargs)

    def _split(self, path: str) -> tuple[str, str]:
        bucket, _, key = path.partition("/")
        return bucket, key

    def _s3(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        bucket, key = self._split(path)
        return sync(self.fs.loop, self.fs._call_s3, method, Bucket=bucket, Key=key, **kw)

    def _put(self, path: str, data: Buffer, **cond: str) -> str:
        body = bytes(data) if isinstance(data, memoryview) else data
        return self._s3("put_object", path, Body=body, **cond)["ETag"]

    def _put_checked(self, path: str, data: Buffer, crc32c: str) -> str:
        # Send the CRC32C we already have: S3 verifies it against the bytes it
        # received (and keeps it), and botocore then skips hashing the body
        # again for its default CRC32 -- a full pass over the data saved.
        if not self._send_checksums:
            return self._put(path, data)
        return self._put(path, data, ChecksumCRC32C=_b64_crc(crc32c))

    def _get(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        if start is None and end is None:
            # One GET. s3fs's cat_file sends a HEAD first to learn the size (and
            # splits objects over 50 MiB into ranged GETs): two requests per object.
            return self._get_versioned(path)[0]
        return super()._get(path, start, end)

    def _put_if_absent(self, path: str, data: Buffer) -> str:
        return self._conditional_put(path, data, IfNoneMatch="*")

    def _put_if_match(self, path: str, data: Buffer, version: str) -> str:
        return self._conditional_put(path, data, IfMatch=version)

    def _conditional_put(self, path: str, data: Buffer, **cond: str) -> str:
        try:
            return self._put(path, data, **cond)
        except FileNotFoundError:
            if "IfMatch" in cond:  # the object vanished: the CAS lost
                raise FileExistsError(path) from None
            raise
        except OSError as exc:
            code = _code(exc)
            if code in ("PreconditionFailed", "ConditionalRequestConflict", "412"):
                raise FileExistsError(path) from exc
            raise

    def _get_versioned(self, path: str) -> tuple[bytes, str]:
        async def read() -> tuple[bytes, str]:
            bucket, key = self._split(path)
            resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key)
            async with resp["Body"] as body:
                return await body.read(), resp["ETag"]

        return sync(self.fs.loop, read)

    def _version_of(self, info: dict[str, Any]) -> str | None:
        return info.get("ETag")

    def _delete(self, paths: list[str]) -> None:
        if paths:
            self.fs.rm(paths)

    def _open_writer(self, path: str) -> RawWriter:
        return _MultipartWriter(self, path)


def _code(exc: BaseException) -> str | None:
    e: BaseException | None = exc
    while e is not None:
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            return response.get("Error", {}).get("Code") or str(
                response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
            )
        e = e.__cause__
    return None


def _b64_crc(crc_hex: str) -> str:
    """8 hex digits -> the base64 of the 4 big-endian bytes S3 headers carry."""
    return base64.b64encode(bytes.fromhex(crc_hex)).decode("ascii")


def _s3fs_options(options: dict[str, Any], max_concurrency: int) -> dict[str, Any]:
    """s3fs options with our defaults filled in where the user set none."""
    opts = copy.deepcopy(options)
    config = dict(opts.pop("config_kwargs", None) or {})
    config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    config.setdefault("connect_timeout", 10)
    config.setdefault("read_timeout", 60)
    config.setdefault("max_pool_connections", max(2 * max_concurrency, 10))
    opts["config_kwargs"] = config
    return opts


class _MultipartWriter(PartWriter):
    """An S3 multipart upload: parts of ``part_size`` (at least 5 MiB) in parallel.

    A small object goes up as one PUT with its CRC32C, which S3 verifies.
    """

    def __init__(self, store: S3Store, path: str) -> None:
        super().__init__(store, path, max(store.part_size, MIN_PART_SIZE))
        self._s3store = store
        self._upload_id: str | None = None

    def _start(self) -> None:
        self._upload_id = self._s3store._s3("create_multipart_upload", self._path)["UploadId"]

    def _upload(self, number: int, part: bytes) -> dict[str, Any]:
        resp = self._s3store._s3("upload_part", self._path, UploadId=self._upload_id,
                                 PartNumber=number, Body=part)
        return {"PartNumber": number, "ETag": resp["ETag"]}

    def _finish(self, tokens: list[Any], size: int, crc32c: str) -> None:
        try:
            self._s3store._s3("complete_multipart_upload", self._path,
                              UploadId=self._upload_id, MultipartUpload={"Parts": tokens})
        except Exception as exc:
            # A completion the server applied but whose response was lost: the retry
            # finds the upload gone. The object is ours if its ETag is the one S3
            # derives from our parts' ETags.
            if _code(exc) != "NoSuchUpload" or not self._is_ours(tokens, size):
                raise

    def _is_ours(self, tokens: list[Any], size: int) -> bool:
        """Whether the object is the one our parts make (its ETag is the MD5 of their
        MD5s; with SSE-KMS ETags are not MD5s, and this says no: the safe answer)."""
        try:
            head = self._s3store.retry.call(lambda: self._s3store._s3("head_object", self._path),
                                            op="head", key=self._path)
            digest = hashlib.md5(b"".join(bytes.fromhex(t["ETag"].strip('"')) for t in tokens),
                                 usedforsecurity=False).hexdigest()
        except Exception:  # noqa: BLE001 - then the original error stands
            return False
        return (head.get("ContentLength") == size
                and head.get("ETag", "").strip('"') == f"{digest}-{len(tokens)}")

    def _single(self, data: bytearray, size: int, crc32c: str) -> None:
        self._s3store._put_checked(self._path, data, crc32c)  # botocore takes a bytearray

    def _abort_upload(self, store: Store) -> None:
        if self._upload_id is not None:
            self._s3store._s3("abort_multipart_upload", self._path, UploadId=self._upload_id)
            self._upload_id = None
