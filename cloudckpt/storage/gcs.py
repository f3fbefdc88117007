"""Google Cloud Storage backend over gcsfs.

Every whole-object write is one multipart upload request, which carries the
precondition natively: ``ifGenerationMatch=0`` for create-only,
``ifGenerationMatch=<generation>`` for compare-and-swap; GCS answers a lost
race with 412. The object's generation is the version token.

Set ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` before gcsfs is imported when
talking to an emulator; this module sets that default itself.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any, ClassVar
from urllib.parse import quote, quote_plus

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import gcsfs  # noqa: E402 - must follow the environment default above
from fsspec.asyn import sync  # noqa: E402

from ..crc import Buffer  # noqa: E402
from ..errors import StorageError  # noqa: E402
from .base import RawWriter, Store  # noqa: E402
from .retry import describe  # noqa: E402


class GCSStore(Store):
    """Objects in a GCS bucket, below an optional prefix."""

    protocols: ClassVar[tuple[str, ...]] = ("gs", "gcs")
    native_conditional_writes: ClassVar[bool] = True

    def __init__(self, root: str, **kwargs: Any) -> None:
        options = dict(kwargs.pop("storage_options", None) or {})
        try:
            fs = gcsfs.GCSFileSystem(**options)
        except Exception as exc:  # noqa: BLE001 - re-raised without the token it may quote
            # gcsfs checks a raw token at https://oauth2.googleapis.com/tokeninfo?
            # access_token=<token>: its errors quote that URL, token and all.
            error = StorageError(
                f"cannot set up GCS access for gs://{root}: "
                f"{_mask(describe(exc), options.get('token'))}; check the token "
                "storage option and that the token service is reachable"
            )
        else:
            error = None
        if error is not None:
            raise error  # outside the except block: no __context__ to quote the token either
        super().__init__(fs, root, protocol="gs", storage_options=options, **kwargs)

    def _split(self, path: str) -> tuple[str, str]:
        bucket, _, key = path.partition("/")
        return bucket, key

    def _upload(self, path: str, data: Buffer, **params: str) -> str:
        bucket, key = self._split(path)
        boundary = f"cloudckpt-{uuid.uuid4().hex}"
        head = (
            f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
            f"{json.dumps({'name': key})}\r\n--{boundary}\r\n"
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        body = head + bytes(data) + f"\r\n--{boundary}--\r\n".encode()
        resp = sync(
            self.fs.loop,
            self.fs._call,
            "POST",
            f"{self.fs._location}/upload/storage/v1/b/{quote(bucket, safe='')}/o",
            uploadType="multipart",
            headers={"Content-Type": f'multipart/related; boundary="{boundary}"'},
            data=body,
            json_out=True,
            **params,
        )
        return str(resp["generation"])

    def _put(self, path: str, data: Buffer) -> str:
        return self._upload(path, data)

    def _put_if_absent(self, path: str, data: Buffer) -> str:
        return self._upload(path, data, ifGenerationMatch="0")

    def _put_if_match(self, path: str, data: Buffer, version: str) -> str:
        try:
            return self._upload(path, data, ifGenerationMatch=version)
        except FileNotFoundError:
            raise FileExistsError(path) from None

    def _get_versioned(self, path: str) -> tuple[bytes, str]:
        bucket, key = self._split(path)
        # Read the generation first, then the bytes of exactly that generation,
        # so data and token always belong together.
        meta = sync(self.fs.loop, self.fs._call, "GET", "b/{}/o/{}", bucket, key,
                    json_out=True)
        generation = str(meta["generation"])
        _, data = sync(self.fs.loop, self.fs._call, "GET", "b/{}/o/{}", bucket, key,
                       alt="media", generation=generation)
        return data, generation

    def _version_of(self, info: dict[str, Any]) -> str | None:
        gen = info.get("generation")
        return str(gen) if gen is not None else None

    def _delete(self, paths: list[str]) -> None:
        if paths:
            try:
                self.fs.rm(paths)
            except FileNotFoundError:
                pass

    def _open_writer(self, path: str) -> RawWriter:
        return _GcsWriter(self, path)


class _GcsWriter(RawWriter):
    """gcsfs's resumable upload; the object appears only when it is closed."""

    def __init__(self, store: GCSStore, path: str) -> None:
        block = max(store.part_size // (256 * 1024), 1) * 256 * 1024  # GCS wants 256 KiB units
        self._f = store.fs.open(path, "wb", block_size=block)

    def write(self, data: Buffer) -> None:
        self._f.write(data)

    def commit(self) -> None:
        self._f.close()

    def abort(self) -> None:
        try:
            self._f.discard()
        except Exception:  # noqa: BLE001 - best effort; an unfinished upload expires
            pass


def _mask(text: str, token: Any) -> str:
    """``text`` with every string in ``token`` (a raw token, or the fields of a
    credentials dict) masked, as is and URL-encoded."""
    values = [token] if isinstance(token, str) else (
        list(token.values()) if isinstance(token, dict) else [])
    methods = {"google_default", "cache", "cloud", "token", "anon", "browser"}
    for v in sorted((v for v in values if isinstance(v, str) and len(v) >= 8
                     and v not in methods), key=len, reverse=True):
        text = text.replace(v, "***").replace(quote_plus(v), "***").replace(quote(v, safe=""),
                                                                              "***")
    return text
