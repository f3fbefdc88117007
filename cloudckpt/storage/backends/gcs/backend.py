"""Google Cloud Storage backend over gcsfs.

Every whole-object write is one multipart upload request, which carries the
precondition natively: ``ifGenerationMatch=0`` for create-only,
``ifGenerationMatch=<generation>`` for compare-and-swap; GCS answers a lost
race with 412. The object's generation is the version token. Whole-object
writes carry their CRC32C, which GCS checks against the bytes it received.

Streamed writes of objects of two parts or more upload the parts as hidden
objects in parallel (``<name>.<id>-<n>.cloudckpt-part``), then compose them
into the object and delete them. The composed object's size and CRC32C must
match what was written, or the write fails: a part stored twice (a retried
request the server had applied) can never hide in a committed object. Part
sizes double every 256 parts, so the 1024 components a GCS object may have
reach 60 GiB with the default 16 MiB parts.

gcsfs retries requests itself (up to six tries with sleeps of 1 to 16 s),
inside each attempt of our :class:`~cloudckpt.storage.RetryPolicy`, which
then could not keep its deadline; this backend runs gcsfs with one try per
request and retries under the policy alone, as the S3 backend does. What
gcsfs's errors mean is in :mod:`.errors`, what it makes of its options in
:mod:`.options`.

gcsfs is reached through :mod:`cloudckpt.compat.gcsfs_private`: its core
filesystem class, whatever ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` says, and the
environment left alone.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable, Mapping
from typing import Any, ClassVar
from urllib.parse import quote, urlencode

from fsspec.asyn import sync

from cloudckpt.compat import gcsfs_private
from cloudckpt.compat.gcsfs_private import OneTryGCSFileSystem
from cloudckpt.errors import StorageError
from cloudckpt.names import PART_SUFFIX
from cloudckpt.storage import versioning
from cloudckpt.storage.backend import Backend, Host
from cloudckpt.storage.backends.gcs import errors as gcs_errors
from cloudckpt.storage.backends.gcs.options import (
    credentials_may_exist,
    mask_token,
    no_credentials,
    searches_credentials,
)
from cloudckpt.storage.fsspec_backend import FsspecBackend
from cloudckpt.storage.objects import ObjectInfo
from cloudckpt.storage.options import init_options
from cloudckpt.storage.retry import describe
from cloudckpt.storage.transfer.bodies import PartBody, Pieces, crc32c_hex_of
from cloudckpt.storage.transfer.httpget import DirectGet
from cloudckpt.storage.transfer.parts import PartWriter
from cloudckpt.storage.transfer.ranges import StreamedRanges
from cloudckpt.storage.writers import RawWriter
from cloudckpt.util.crc import Buffer, crc32c_b64, crc32c_from_b64

log = logging.getLogger(__name__)


class GCSBackend(StreamedRanges, FsspecBackend):
    """Objects in a GCS bucket, below an optional prefix."""

    protocols: ClassVar[tuple[str, ...]] = ("gs", "gcs")
    native_conditional_writes: ClassVar[bool] = True
    probe_stale_version: ClassVar[str | None] = "1"
    classify = staticmethod(gcs_errors.classify)

    @classmethod
    def filesystem_options(cls) -> frozenset[str] | None:
        return init_options(OneTryGCSFileSystem) - {"loop", "asynchronous"}

    def _filesystem(self, options: dict[str, Any]) -> OneTryGCSFileSystem:
        root = self.root
        searched = searches_credentials(options)
        if searched and not credentials_may_exist():
            raise no_credentials(root)
        try:
            fs = OneTryGCSFileSystem(**options)
        except Exception as exc:  # noqa: BLE001 - re-raised without the token it may quote
            # gcsfs checks a raw token at https://oauth2.googleapis.com/tokeninfo?
            # access_token=<token>: its errors quote that URL, token and all.
            error: StorageError | None = StorageError(
                f"cannot set up GCS access for gs://{root}: "
                f"{mask_token(describe(exc), options.get('token'))}; check the token "
                "storage option and that the token service is reachable"
            )
        else:
            error = None
        if error is not None:
            raise error  # outside the except block: no __context__ to quote the token either
        if searched and getattr(getattr(fs, "credentials", None), "method", None) == "anon":
            raise no_credentials(root)  # gcsfs found none and fell back to anonymous access
        return fs

    def _split(self, path: str) -> tuple[str, str]:
        bucket, _, key = path.partition("/")
        return bucket, key

    def _api(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        """One request of the JSON API through gcsfs's session (one try)."""
        return sync(self.fs.loop, gcsfs_private.call, self.fs, method, path, *args, **kwargs)

    def _upload(self, path: str, data: Buffer | Pieces, crc32c: str | None = None,
                **params: str) -> str:
        bucket, key = self._split(path)
        boundary = f"cloudckpt-{uuid.uuid4().hex}"
        meta: dict[str, str] = {"name": key}
        if crc32c is not None:  # GCS refuses the upload if the bytes do not match
            meta["crc32c"] = crc32c_b64(crc32c)
        head = (
            f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n"
            f"{json.dumps(meta)}\r\n--{boundary}\r\n"
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        # A file over the three pieces: neither concatenated nor copied whole by aiohttp.
        body = PartBody(head, data, f"\r\n--{boundary}--\r\n".encode())
        resp = self._api(
            "POST",
            f"{gcsfs_private.location(self.fs)}/upload/storage/v1/b/{quote(bucket, safe='')}/o",
            uploadType="multipart",
            headers={"Content-Type": f'multipart/related; boundary="{boundary}"'},
            data=body,
            json_out=True,
            **params,
        )
        return str(resp["generation"])

    def put(self, path: str, data: Buffer) -> str:
        return self._upload(path, data)

    def put_checked(self, path: str, data: Buffer | Pieces, crc32c: str) -> str:
        return self._upload(path, data, crc32c)

    def _compose(self, path: str, sources: list[str]) -> dict[str, Any]:
        bucket, key = self._split(path)
        body = {"sourceObjects": [{"name": self._split(p)[1]} for p in sources],
                "destination": {"name": key}}
        return self._api("POST", "b/{}/o/{}/compose", bucket, key, json_out=True, json=body)

    def put_if_absent(self, path: str, data: Buffer) -> str:
        return self._upload(path, data, ifGenerationMatch="0")

    def put_if_match(self, path: str, data: Buffer, version: str) -> str:
        try:
            return self._upload(path, data, ifGenerationMatch=version)
        except FileNotFoundError:
            raise FileExistsError(path) from None

    def get_versioned(self, path: str) -> tuple[bytes, str]:
        bucket, key = self._split(path)
        # Read the generation first, then the bytes of exactly that generation,
        # so data and token always belong together.
        meta = self._api("GET", "b/{}/o/{}", bucket, key, json_out=True)
        generation = str(meta["generation"])
        _, data = self._api("GET", "b/{}/o/{}", bucket, key, alt="media",
                            generation=generation)
        return data, generation

    def version_of(self, info: Mapping[str, Any]) -> str | None:
        gen = info.get("generation")
        return str(gen) if gen is not None else None

    def delete(self, paths: list[str], root: str) -> None:
        # Literal names: gcsfs's rm() expands glob characters ("run[1]/a" is a pattern).
        if not paths:
            return
        results = sync(self.fs.loop, gcsfs_private.delete_files, self.fs, list(paths), 100)
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, FileNotFoundError):
                raise r
        for p in paths:
            self.fs.invalidate_cache(p)

    def bucket_exists(self, root: str) -> bool | None:
        try:
            self._api("GET", "b/{}", self._split(root)[0], json_out=True)
        except FileNotFoundError:
            return False
        return True

    def bucket_versioning(self, root: str) -> str:
        # GCS has no "suspended": with versioning off, a delete removes the live object.
        meta = self._api("GET", "b/{}", self._split(root)[0], fields="versioning",
                         json_out=True)
        on = (meta.get("versioning") or {}).get("enabled")
        return versioning.ENABLED if on else versioning.OFF

    def open_writer(self, path: str, host: Host) -> RawWriter:
        return _ComposeWriter(self, host, path)

    async def direct_get(self, path: str) -> DirectGet | None:
        # The media GET with gcsfs's headers (its credentials); not where the user set
        # session options, which only gcsfs's session honours.
        fs = self.fs
        await gcsfs_private.session(fs)
        if fs.session_kwargs:
            return None
        params = gcsfs_private.params(fs)
        return DirectGet(fs.url(path) + (f"&{urlencode(params)}" if params else ""),
                         headers=gcsfs_private.headers(fs),
                         timeout=float(fs.requests_timeout or 60))

    async def open_range(self, path: str, start: int, end: int
                         ) -> tuple[Any, Callable[[], None]]:
        # One ranged GET whose body is read as it arrives (gcsfs's own calls read
        # whole bodies).
        fs = self.fs
        session = await gcsfs_private.session(fs)
        resp = await session.get(
            fs.url(path), params=gcsfs_private.params(fs),
            headers=gcsfs_private.headers(fs, {"Range": f"bytes={start}-{end - 1}"}),
            timeout=fs.requests_timeout)
        if resp.status >= 300:
            from gcsfs.retry import validate_response  # gcsfs is imported by now

            try:
                body = await resp.read()
            finally:
                resp.release()
            validate_response(resp.status, body, path)  # gcsfs's errors, as its calls
            raise StorageError(f"GET gs://{path}: HTTP {resp.status}")
        if resp.status != 206 and (start > 0 or (resp.content_length or 0) > end - start):
            resp.release()
            raise StorageError(f"gs://{path}: the server ignored the byte range "
                               f"[{start}, {end})")
        return resp.content, resp.release

    def can_copy_from(self, other: Backend) -> bool:
        # A rewrite reads the source with the destination's credentials: only on one
        # endpoint with the same ones is that sure to work.
        return self.same_service(other)

    def copy(self, src_path: str, path: str, size: int, host: Host) -> ObjectInfo:
        # objects.rewrite: one call within a location and storage class; GCS may ask
        # for more (rewriteToken) for large objects between locations or classes.
        # Each call is retried on its own; a token stays valid across retries.
        src_bucket, src_key = self._split(src_path)
        bucket, key = self._split(path)
        token: str | None = None
        while True:
            params = {"rewriteToken": token} if token else {}
            out = host.retry.call(
                lambda params=params: self._api(  # type: ignore[misc]  # mypy: a lambda with a default
                    "POST", "b/{}/o/{}/rewriteTo/b/{}/o/{}",
                    src_bucket, src_key, bucket, key, json_out=True,
                    headers={"Content-Type": "application/json"}, **params),
                op="copy", key=f"gs://{path}", errors=self)
            if out.get("done"):
                break
            token = out.get("rewriteToken")
            if not token:
                raise StorageError(f"copy to gs://{path}: the rewrite is not done and "
                                   "gave no token to continue it")
        res = out.get("resource") or {}
        crc = res.get("crc32c")
        try:
            crc_hex = crc32c_from_b64(crc) if crc else None
        except ValueError:
            crc_hex = None
        gen = res.get("generation")
        return ObjectInfo(path, int(res.get("size", -1)), crc_hex,
                          str(gen) if gen is not None else None)


#: Sources per compose request, and components per object (GCS limits).
_COMPOSE_SOURCES, _MAX_COMPONENTS = 32, 1024


class _ComposeWriter(PartWriter):
    """Parts as hidden objects uploaded in parallel, composed into one and checked."""

    MAX_PARTS = _MAX_COMPONENTS

    def __init__(self, backend: GCSBackend, host: Host, path: str) -> None:
        super().__init__(backend, host, path, max(host.part_size, 256 * 1024))
        self._gcs = backend
        self._id = uuid.uuid4().hex[:8]
        self._composed: list[str] = []  # intermediate objects of a compose tree

    def part_size_of(self, number: int) -> int:
        return self._part_size << ((number - 1) // 256)

    def _part_name(self, tag: str) -> str:
        return f"{self._path}.{self._id}-{tag}{PART_SUFFIX}"

    def _upload(self, number: int, part: memoryview | Pieces) -> str:
        name = self._part_name(f"{number:04d}")
        self._gcs.put_checked(name, part, crc32c_hex_of(part))
        return name

    def _finish(self, tokens: list[Any], size: int, crc32c: str) -> None:
        sources = list(tokens)
        level = 0
        while len(sources) > _COMPOSE_SOURCES:  # compose in a tree, 32 at a time
            level += 1
            sources = [self._compose_into(self._part_name(f"c{level}-{i:03d}"),
                                          sources[j:j + _COMPOSE_SOURCES])
                       for i, j in enumerate(range(0, len(sources), _COMPOSE_SOURCES))]
        meta = self._gcs._compose(self._path, sources)
        got_size, got_crc = int(meta.get("size", -1)), meta.get("crc32c")
        if got_size != size or (got_crc is not None and got_crc != crc32c_b64(crc32c)):
            self._store.delete([self._gcs_key(self._path)])  # a failed write leaves no object
            raise StorageError(
                f"gs://{self._path} was composed with {got_size} bytes (CRC32C {got_crc}), "
                f"but {size} bytes (CRC32C {crc32c_b64(crc32c)}) were written: a part was "
                "stored wrongly; the write failed and the object was removed")

    def _compose_into(self, name: str, sources: list[str]) -> str:
        if name not in self._composed:
            self._composed.append(name)  # recorded first: an abort deletes it too
        self._gcs._compose(name, sources)
        return name

    def _single(self, data: memoryview | Pieces, size: int, crc32c: str) -> None:
        self._gcs.put_checked(self._path, data, crc32c)

    def _cleanup(self, tokens: list[Any]) -> None:
        leftovers = list(tokens) + self._composed
        try:
            self._store.delete([self._gcs_key(p) for p in leftovers])
        except Exception as exc:  # noqa: BLE001 - hidden from listings; only space is lost
            log.warning("could not delete the parts of gs://%s: %s", self._path, exc)

    def _abort_upload(self, store: Host) -> None:
        # Every part that may exist (by its name, whatever became of its future) and
        # every intermediate of a compose tree.
        names = [self._part_name(f"{n:04d}") for n in range(1, len(self._parts) + 1)]
        store.delete([self._gcs_key(p) for p in names + self._composed])

    def _gcs_key(self, path: str) -> str:
        return path[len(self._store.root) + 1:]
