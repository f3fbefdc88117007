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
Listings, heads and reads are adlfs's.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Mapping
from typing import Any, ClassVar

import adlfs
from azure.core import MatchConditions
from azure.core.exceptions import (
    AzureError,
    HttpResponseError,
    ResourceExistsError,
    ResourceModifiedError,
    ResourceNotFoundError,
    ServiceRequestError,
    ServiceResponseError,
)
from fsspec.asyn import sync

from cloudckpt.storage.backend import Host
from cloudckpt.storage.base import Store
from cloudckpt.storage.options import init_options
from cloudckpt.storage.parts import PartBody, PartWriter
from cloudckpt.storage.primitives import FsspecBackend
from cloudckpt.storage.retry import Classified, Failure
from cloudckpt.storage.writers import RawWriter
from cloudckpt.util.crc import Buffer

#: Azure's most blocks per blob.
_MAX_BLOCKS = 50_000
#: Error codes worth retrying whatever their status says.
_TRANSIENT_CODES = frozenset({"ServerBusy", "OperationTimedOut", "InternalError"})


class AzureBackend(FsspecBackend):
    """Blobs in an Azure container, below an optional prefix."""

    protocols: ClassVar[tuple[str, ...]] = ("az", "abfs", "abfss")
    native_conditional_writes: ClassVar[bool] = True
    probe_stale_version: ClassVar[str | None] = '"0x8D000000000000F"'

    @classmethod
    def filesystem_options(cls) -> frozenset[str] | None:
        return init_options(adlfs.AzureBlobFileSystem) - {"loop", "asynchronous"}

    def _filesystem(self, options: dict[str, Any]) -> adlfs.AzureBlobFileSystem:
        return adlfs.AzureBlobFileSystem(**options)

    def _root_of(self, root: str) -> str:
        # abfss://container@account.dfs.core.windows.net/prefix names the container
        # before the "@"; adlfs takes the account from the options or environment.
        head, sep, rest = root.partition("/")
        return head.split("@", 1)[0] + sep + rest

    def _client(self, path: str) -> Any:
        container, _, key = path.partition("/")
        return self.fs.service_client.get_blob_client(container, key)

    def _upload(self, path: str, data: Buffer, **conditions: Any) -> str:
        body = PartBody(data)

        async def upload() -> Any:
            return await self._client(path).upload_blob(body, length=len(body), **conditions)

        return str(sync(self.fs.loop, upload)["etag"])

    def put(self, path: str, data: Buffer) -> str:
        return self._upload(path, data, overwrite=True)

    def put_if_absent(self, path: str, data: Buffer) -> str:
        try:
            return self._upload(path, data, overwrite=False)
        except ResourceExistsError:
            raise FileExistsError(path) from None

    def put_if_match(self, path: str, data: Buffer, version: str) -> str:
        try:
            return self._upload(path, data, overwrite=True, etag=version,
                                match_condition=MatchConditions.IfNotModified)
        except (ResourceModifiedError, ResourceNotFoundError):
            raise FileExistsError(path) from None

    def get_versioned(self, path: str) -> tuple[bytes, str]:
        async def download() -> tuple[bytes, str]:
            stream = await self._client(path).download_blob()
            return await stream.readall(), str(stream.properties.etag)

        try:
            return sync(self.fs.loop, download)
        except ResourceNotFoundError:
            raise FileNotFoundError(path) from None

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
            import asyncio

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

    def classify(self, exc: BaseException) -> Classified | None:
        return classify(exc)


def classify(exc: BaseException) -> Classified | None:
    """What Azure says of one exception of a failure's chain (None: not the SDK's)."""
    if isinstance(exc, ResourceNotFoundError):
        return Classified(Failure.NOT_FOUND, 404, getattr(exc, "error_code", None))
    if isinstance(exc, HttpResponseError) and exc.status_code:
        code = str(exc.error_code) if exc.error_code else None
        transient = code in _TRANSIENT_CODES
        return Classified(Failure.TRANSIENT if transient else None, exc.status_code, code)
    if isinstance(exc, (ServiceRequestError, ServiceResponseError)):
        return Classified(Failure.TRANSIENT)  # the connection failed or broke
    if isinstance(exc, AzureError) and "credential" in type(exc).__name__.lower():
        return Classified(Failure.NO_CREDENTIALS)
    return None


class _BlockWriter(PartWriter):
    """Blocks staged in parallel, then one Put Block List makes the blob."""

    MAX_PARTS = _MAX_BLOCKS

    def __init__(self, backend: AzureBackend, host: Host, path: str) -> None:
        super().__init__(backend, host, path, host.part_size)
        self._azure = backend
        self._id = uuid.uuid4().hex[:16]

    def _upload(self, number: int, part: memoryview) -> str:
        # Block ids: base64, all of one length within a blob; unique per writer, so a
        # racing writer's blocks can never be committed into our list.
        block_id = base64.b64encode(f"{self._id}-{number:06d}".encode()).decode()
        body = PartBody(part)

        async def stage() -> None:
            await self._azure._client(self._path).stage_block(block_id, body, length=len(body))

        sync(self._azure.fs.loop, stage)
        return block_id

    def _finish(self, tokens: list[Any], size: int, crc32c: str) -> None:
        from azure.storage.blob import BlobBlock

        async def commit() -> None:
            await self._azure._client(self._path).commit_block_list(
                [BlobBlock(block_id=t) for t in tokens])

        sync(self._azure.fs.loop, commit)
        self._azure.fs.invalidate_cache(self._path)

    def _single(self, data: memoryview, size: int, crc32c: str) -> None:
        self._azure.put(self._path, data)


class AzureStore(Store):
    """A :class:`Store` over an :class:`AzureBackend`."""

    backend_class = AzureBackend
