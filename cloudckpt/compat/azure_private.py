"""azure-storage-blob's private internals: the generated operations under its clients,
and the configuration of a service client's pipeline.

The public ``upload_blob`` copies a body into one ``bytes`` before sending it, and the
public downloader holds each response whole; the generated operations under them send
our buffers as they are and hand over a response unread, through the same pipeline,
credentials and errors. The pipeline's configuration is where adlfs's clients get their
read sizes and retries, which cloudckpt sets.
"""

from __future__ import annotations

from typing import Any

try:
    from azure.storage.blob._generated.models import ModifiedAccessConditions
    from azure.storage.blob.aio import BlobClient, BlobServiceClient
except ImportError as exc:  # the az:// backend's extra, not in a plain install
    raise ImportError(f"az:// needs azure-storage-blob ({exc}): "
                      "pip install 'cloudckpt[azure]'") from exc

from cloudckpt.compat import Internal

_URL = "https://cloudckpt.blob.core.windows.net"  # never contacted: the clients connect lazily


def _service() -> BlobServiceClient:
    return BlobServiceClient(_URL)


def _blob() -> BlobClient:
    return BlobClient(_URL, "container", "blob")


_SERVICE = "azure.storage.blob.aio.BlobServiceClient()"
_BLOB = "azure.storage.blob.aio.BlobClient()"

INTERNALS = {
    "azure.storage.blob._generated.models.ModifiedAccessConditions": Internal(
        "the If-None-Match / If-Match of a generated Put Blob"),
    f"{_SERVICE}._config.max_single_get_size": Internal(
        "the first request of adlfs's whole-object reads (32 MiB held whole by default)",
        _service),
    f"{_SERVICE}._config.max_chunk_get_size": Internal(
        "the later requests of those reads", _service),
    f"{_SERVICE}._config.retry_policy.total_retries": Internal(
        "the SDK's own retries, turned off: retries are cloudckpt's, under its deadline",
        _service),
    f"{_BLOB}._client.block_blob.upload": Internal(
        "Put Blob sending our buffers as they are (upload_blob copies them first)", _blob),
    f"{_BLOB}._client.blob.download": Internal(
        "a ranged GET whose response is read as it arrives", _blob),
}

def service_config(service_client: BlobServiceClient) -> Any:
    """``BlobServiceClient._config``: the configuration of the client's pipeline, which
    the blob clients it makes share."""
    return service_client._config


async def put_blob(client: BlobClient, body: Any, length: int, conditions: dict[str, str],
                   **checksums: Any) -> dict[str, Any]:
    """Put Blob through ``BlobClient._client.block_blob.upload``: ``body`` (a file-like
    object of ``length`` bytes) sent as it is, under the ``If-None-Match``/``If-Match``
    in ``conditions`` and the transactional checksum keyword in ``checksums``; returns
    the response's headers."""
    return await client._client.block_blob.upload(
        content_length=length, body=body, **checksums,
        modified_access_conditions=ModifiedAccessConditions(**conditions),  # type: ignore[arg-type]  # the ETag ones, strings
        cls=lambda _response, _body, headers: headers)


async def get_response(client: BlobClient, start: int, end: int) -> Any:
    """A ranged Get Blob of bytes ``[start, end)`` through ``BlobClient._client.blob.
    download``: the pipeline's response, its body not read yet."""
    return await client._client.blob.download(range=f"bytes={start}-{end - 1}",
                                              cls=lambda response, *_: response)
