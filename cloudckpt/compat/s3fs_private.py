"""s3fs's private internal: its one call into botocore.

cloudckpt sends S3 requests s3fs has no public call for (conditional puts, HEAD without
a listing, DeleteObjects with literal keys, ranged GETs read as they arrive) through
s3fs's client, so they share its session, credentials, endpoint and error translation.
"""

from __future__ import annotations

from typing import Any

import s3fs

from cloudckpt.compat import Internal

INTERNALS = {
    "s3fs.S3FileSystem._call_s3": Internal(
        "one botocore operation on s3fs's client, its errors translated as s3fs's own "
        "calls translate them"),
}


async def call_s3(fs: s3fs.S3FileSystem, method: str, **kwargs: Any) -> Any:
    """``s3fs.S3FileSystem._call_s3``: the botocore operation ``method`` (``put_object``,
    ``head_object``...) with ``kwargs``, an OSError (``FileNotFoundError``...) for
    botocore's errors."""
    return await fs._call_s3(method, **kwargs)
