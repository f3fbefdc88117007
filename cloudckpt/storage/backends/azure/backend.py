"""Azure Blob Storage backend over adlfs and azure-storage-blob's async client.

URIs are ``az://container/prefix`` (also ``abfs://`` and ``abfss://``); the
storage options are adlfs's (``connection_string``, ``account_name`` with
``account_key``, ``sas_token`` or ``credential``, ``anon``), and adlfs reads the
usual environment (``AZURE_STORAGE_CONNECTION_STRING``, ``AZURE_STORAGE_ACCOUNT_NAME``
and ``..._KEY`` / ``..._SAS_TOKEN``, else ``DefaultAzureCredential``).

Azure enforces conditions natively: create-only is Put Blob with ``If-None-Match: *``
(409 ``BlobAlreadyExists`` for a lost race), compare-and-swap is ``If-Match: <etag>``
(412); the ETag is the version token. Streamed writes stage blocks in parallel
(Put Block) and commit them in one Put Block List, which makes the blob appear
whole; blocks never committed are invisible and the service drops them after a week.
Put Blob and ranged GETs go through the SDK's generated operations (its pipeline,
credentials and errors) so that bodies stream from and to our buffers: the public
calls copy each upload into one ``bytes`` and hold each download chunk whole.
Heads and listings are one Get Blob Properties and one List Blobs per 5,000 names
(adlfs's make two requests each); whole-object reads and ``ls`` are adlfs's.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import hashlib
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

try:
    import adlfs
    from azure.storage.blob import BlobBlock, BlobSasPermissions, generate_blob_sas

    from cloudckpt.compat import azure_private
except ImportError as exc:
    raise ImportError(f"az:// and abfs:// need adlfs and azure-storage-blob ({exc}): "
                      "pip install 'cloudckpt[azure]'") from exc
try:
    from azure.storage.extensions.checksums import crc64 as _crc64
except ImportError:
    _crc64 = None  # type: ignore[assignment]  # absent: transfer_checksum="crc64" refused
from azure.core.exceptions import HttpResponseError, ResourceNotFoundError
from fsspec.asyn import sync

from cloudckpt.errors import ConfigError, StorageError
from cloudckpt.storage.backend import Backend, Host
from cloudckpt.storage.backends.azure.errors import classify
from cloudckpt.storage.backends.azure.options import TRANSFER_CHECKS, adlfs_options
from cloudckpt.storage.fsspec_backend import FsspecBackend
from cloudckpt.storage.objects import ObjectInfo
from cloudckpt.storage.options import init_options
from cloudckpt.storage.transfer.bodies import PartBody, Pieces, segments_of
from cloudckpt.storage.transfer.httpget import DirectGet
from cloudckpt.storage.transfer.parts import PartWriter
from cloudckpt.storage.transfer.ranges import StreamedRanges
from cloudckpt.storage.writers import RawWriter
from cloudckpt.util.crc import Buffer

#: Azure's most blocks per blob.
_MAX_BLOCKS = 50_000
#: Bytes copied at a time for the CRC64 extension (see crc64_of).
_CRC_SLICE = 256 << 10
#: Bytes per request of adlfs's whole-object reads (see _filesystem).
_GET_SIZE = 8 << 20
#: How long a copy the service runs in the background may take.
_COPY_TIMEOUT = 3600.0
#: How long the SAS of a ranged GET is valid (it is used at once).
_SAS_FOR = 900
#: Seconds a ranged GET may go without a byte.
_READ_TIMEOUT = 60.0


class AzureBackend(StreamedRanges, FsspecBackend):
    """Blobs in an Azure container, below an optional prefix."""

    protocols: ClassVar[tuple[str, ...]] = ("az", "abfs", "abfss")
    native_conditional_writes: ClassVar[bool] = True
    probe_stale_version: ClassVar[str | None] = '"0x8D000000000000F"'

    @classmethod
    def filesystem_options(cls) -> frozenset[str] | None:
        return init_options(adlfs.AzureBlobFileSystem) - {"loop", "asynchronous"}

    def _read_options(self, scheme: str, options: dict[str, Any]) -> dict[str, Any]:
        check = options.get("transfer_checksum", "crc64")
        if check not in TRANSFER_CHECKS:
            raise ConfigError(f"{scheme}:// storage option transfer_checksum={check!r}: "
                              f"expected one of {', '.join(map(repr, TRANSFER_CHECKS))}")
        if check == "crc64" and _crc64 is None:
            raise ConfigError(f"{scheme}:// checks each request with CRC64, which needs "
                              "azure-storage-extensions: pip install 'cloudckpt[azure]', or "
                              "set the storage option transfer_checksum='md5' (or 'none')")
        self._check = check
        # adlfs's options checked as every backend's (direct_gets taken out there);
        # transfer_checksum stays, so that stores differing only there are told apart.
        rest = super()._read_options(scheme, adlfs_options(options))
        return {**rest, **{k: v for k, v in options.items() if k == "transfer_checksum"}}

    def _filesystem(self, options: dict[str, Any]) -> adlfs.AzureBlobFileSystem:
        fs = adlfs.AzureBlobFileSystem(**adlfs_options(options))
        # The requests of adlfs's whole-object reads (manifests, metadata): the SDK
        # holds each body whole, and its first is 32 MiB by default.
        config = azure_private.service_config(fs.service_client)
        config.max_single_get_size = config.max_chunk_get_size = _GET_SIZE
        # One try per request: retries are cloudckpt's, under its deadline (the SDK's
        # own policy retries 10 times from 15 s back-off, inside each of ours).
        config.retry_policy.total_retries = 0
        return fs

    def checked(self, data: Buffer | Pieces) -> dict[str, Any]:
        """The keyword that has the service check a request's body (see
        ``transfer_checksum``): the SDK's transactional CRC64 or MD5 header."""
        if self._check == "crc64":
            return {"transactional_content_crc64": crc64_of(data).to_bytes(8, "little")}
        if self._check == "md5":
            md5 = hashlib.md5()
            for view in segments_of(data):
                md5.update(view)
            return {"transactional_content_md5": md5.digest()}
        return {}

    def _root_of(self, root: str) -> str:
        # abfss://container@account.dfs.core.windows.net/prefix names the container
        # before the "@"; adlfs takes the account from the options or environment.
        head, sep, rest = root.partition("/")
        return head.split("@", 1)[0] + sep + rest

    def _client(self, path: str) -> Any:
        container, _, key = path.partition("/")
        return self.fs.service_client.get_blob_client(container, key)

    def _upload(self, path: str, data: Buffer | Pieces, **conditions: str) -> str:
        # One Put Blob through the SDK's generated operation (its pipeline, credentials
        # and errors): the public upload_blob reads the body into one bytes copy first,
        # which held 16 MiB per request in flight. ``conditions``: If-None-Match or
        # If-Match, enforced by the service.
        body = PartBody(data)

        async def upload() -> Any:
            return await azure_private.put_blob(self._client(path), body, len(body),
                                                conditions, **self.checked(data))

        return str(sync(self.fs.loop, upload)["ETag"])

    def put(self, path: str, data: Buffer | Pieces) -> str:
        return self._upload(path, data)

    def put_if_absent(self, path: str, data: Buffer) -> str:
        try:
            return self._upload(path, data, if_none_match="*")
        except HttpResponseError as exc:  # 409 BlobAlreadyExists
            if exc.status_code in (409, 412):
                raise FileExistsError(path) from None
            raise

    def put_if_match(self, path: str, data: Buffer, version: str) -> str:
        try:
            return self._upload(path, data, if_match=version)
        except HttpResponseError as exc:  # 412 ConditionNotMet; 404: deleted since
            if exc.status_code in (404, 412):
                raise FileExistsError(path) from None
            raise

    def get_versioned(self, path: str) -> tuple[bytes, str]:
        async def download() -> tuple[bytes, str]:
            stream = await self._client(path).download_blob()
            return await stream.readall(), str(stream.properties.etag)

        try:
            return sync(self.fs.loop, download)
        except ResourceNotFoundError:
            raise FileNotFoundError(path) from None

    def head(self, path: str) -> dict[str, Any] | None:
        # One Get Blob Properties: adlfs's info lists the container after a 404 (to
        # tell a "directory"), two requests for every check of a manifest not yet there.
        if "/" not in path.strip("/"):
            return None

        async def properties() -> Any:
            return await self._client(path).get_blob_properties()

        try:
            return _entry(path, sync(self.fs.loop, properties))
        except ResourceNotFoundError:
            return None

    def find(self, path: str) -> dict[str, dict[str, Any]]:
        # One List Blobs per 5,000 names: adlfs's find asks whether ``path`` is a
        # blob itself first. Directory markers of accounts with a hierarchical
        # namespace (metadata hdi_isfolder) are no objects.
        container, _, key = path.strip("/").partition("/")

        async def listing() -> dict[str, dict[str, Any]]:
            client = self.fs.service_client.get_container_client(container)
            return {f"{container}/{b.name}": _entry(f"{container}/{b.name}", b)
                    async for b in client.list_blobs(name_starts_with=f"{key}/" if key else None,
                                                     include=["metadata"])
                    if (b.metadata or {}).get("hdi_isfolder") != "true"}

        try:
            return sync(self.fs.loop, listing)
        except ResourceNotFoundError:  # no such container
            return {}

    def version_of(self, info: Mapping[str, Any]) -> str | None:
        etag = info.get("etag")
        return str(etag) if etag else None

    def delete(self, paths: list[str], root: str) -> None:
        async def delete_one(path: str) -> None:
            try:
                await self._client(path).delete_blob()
            except ResourceNotFoundError:
                pass

        async def delete_all() -> None:
            for i in range(0, len(paths), 64):
                await asyncio.gather(*(delete_one(p) for p in paths[i:i + 64]))

        if paths:
            sync(self.fs.loop, delete_all)
            for p in paths:
                self.fs.invalidate_cache(p)

    def bucket_exists(self, root: str) -> bool | None:
        async def exists() -> bool:
            return bool(await self.fs.service_client.get_container_client(
                root.split("/", 1)[0]).exists())

        return sync(self.fs.loop, exists)

    def open_writer(self, path: str, host: Host) -> RawWriter:
        return _BlockWriter(self, host, path)

    async def open_range(self, path: str, start: int, end: int
                         ) -> tuple[Any, Callable[[], None]]:
        # One ranged GET whose body is read as it arrives: the SDK's downloader would
        # hold each request's whole body, so this takes the response from the SDK's
        # generated operation (its pipeline, credentials and errors) unread.
        try:
            got = await azure_private.get_response(self._client(path), start, end)
        except ResourceNotFoundError:
            raise FileNotFoundError(path) from None
        resp = got.http_response.internal_response
        if resp.status != 206 and (start > 0 or (resp.content_length or 0) > end - start):
            resp.release()
            raise StorageError(f"az://{path}: the server ignored the byte range "
                               f"[{start}, {end})")
        return resp.content, resp.release

    async def direct_get(self, path: str) -> DirectGet | None:
        # With an account key: the blob's URL under a read-only SAS of a few minutes
        # (aiohttp would buffer each response of a load apart, 6-9 MiB for 16 at once).
        url = self._signed_url(path)
        return None if url is None else DirectGet(url, timeout=_READ_TIMEOUT)

    def _signed_url(self, path: str) -> str | None:
        """The blob's URL with a read-only SAS of :data:`_SAS_FOR` seconds, signed with
        the account key; None under other credentials (the SDK's GET then)."""
        credential = self.fs.service_client.credential
        key = getattr(credential, "account_key", None)
        if not key:
            return None
        container, _, blob = path.partition("/")
        sas = generate_blob_sas(
            credential.account_name, container, blob, account_key=key,
            permission=BlobSasPermissions(read=True),
            expiry=datetime.datetime.now(datetime.timezone.utc) +
            datetime.timedelta(seconds=_SAS_FOR))
        return f"{self._client(path).url}?{sas}"

    def can_copy_from(self, other: Backend) -> bool:
        # Copy Blob reads the source with the destination's credentials: one account
        # with the same ones.
        return self.same_service(other)

    def copy(self, src_path: str, path: str, size: int, host: Host) -> ObjectInfo:
        # Copy Blob: within an account usually done on return; else polled until
        # the service says it is. Azure keeps no CRC32C: the caller reads it back.
        source = self._client(src_path).url
        target = self._client(path)

        async def start() -> Any:
            return await target.start_copy_from_url(source)

        async def status() -> Any:
            return (await target.get_blob_properties()).copy

        out = host.retry.call(lambda: sync(self.fs.loop, start), op="copy",
                              key=f"az://{path}", errors=self)
        state, deadline = out.get("copy_status"), time.monotonic() + _COPY_TIMEOUT
        while state == "pending":
            if time.monotonic() > deadline:
                raise StorageError(f"copy to az://{path}: still pending after "
                                   f"{_COPY_TIMEOUT:.0f} s")
            time.sleep(0.2)
            props = host.retry.call(lambda: sync(self.fs.loop, status), op="copy",
                                    key=f"az://{path}", errors=self)
            state = props.status
        if state != "success":
            raise StorageError(f"copy of az://{src_path} to az://{path}: {state}")
        self.fs.invalidate_cache(path)
        info = self.head(path) or {}
        return ObjectInfo(path, int(info.get("size", -1)), None, self.version_of(info))

    classify = staticmethod(classify)


def _entry(name: str, props: Any) -> dict[str, Any]:
    """A listing entry, as adlfs words one, from the SDK's blob properties."""
    return {"name": name, "type": "file", "size": props.size, "etag": props.etag,
            "last_modified": props.last_modified}


def block_id_of(writer: str, number: int) -> str:
    """Block ids: base64, all of one length within a blob (Azure refuses a mix), and
    unique per writer, so a racing writer's blocks never enter our list."""
    return base64.b64encode(f"{writer}-{number:06d}".encode()).decode()


def crc64_of(data: Buffer | Pieces) -> int:
    """Azure's CRC64 of ``data``: the extension takes only bytes, so a buffer is
    passed a slice at a time (a cache-sized copy, not one of the whole part)."""
    if isinstance(data, bytes):
        return _crc64.compute(data, 0)
    crc = 0
    for view in segments_of(data):
        for i in range(0, len(view), _CRC_SLICE):
            crc = _crc64.compute(bytes(view[i:i + _CRC_SLICE]), crc)
    return crc


class _BlockWriter(PartWriter):
    """Blocks staged in parallel, then one Put Block List makes the blob."""

    MAX_PARTS = _MAX_BLOCKS

    def __init__(self, backend: AzureBackend, host: Host, path: str) -> None:
        super().__init__(backend, host, path, host.part_size)
        self._azure = backend
        self._id = uuid.uuid4().hex[:16]

    def _upload(self, number: int, part: memoryview | Pieces) -> str:
        block_id, body = block_id_of(self._id, number), PartBody(part)

        async def stage() -> None:
            await self._azure._client(self._path).stage_block(
                block_id, body, length=len(body), **self._azure.checked(part))

        sync(self._azure.fs.loop, stage)
        return block_id

    def _finish(self, tokens: list[Any], size: int, crc32c: str) -> None:
        async def commit() -> None:
            await self._azure._client(self._path).commit_block_list(
                [BlobBlock(block_id=t) for t in tokens])

        sync(self._azure.fs.loop, commit)
        self._azure.fs.invalidate_cache(self._path)

    def _single(self, data: memoryview | Pieces, size: int, crc32c: str) -> None:
        self._azure.put(self._path, data)
