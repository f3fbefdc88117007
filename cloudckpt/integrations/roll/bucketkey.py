"""ROLL's one key: ``checkpoint_config.output_dir`` set to a bucket URI with the type
left at ROLL's ``file_system``. ROLL's ``FileSystemUploader`` would hand that URI to
``os.makedirs`` (a local directory named ``s3:``); under activation the registry's
``file_system`` entry sends a bucket URI to cloudckpt's uploader instead, and a local path
to ROLL's own class, unchanged.

ROLL's ``BaseConfig`` appends ``/%Y%m%d-%H%M%S`` to a ``file_system`` output_dir, so a
restarted job would never find its own checkpoints; that suffix is taken off a bucket
URI, which is used as the user wrote it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from cloudckpt.storage import schemes_like

#: The suffix ROLL's BaseConfig appends to a ``file_system`` output_dir.
ROLL_TIMESTAMP = re.compile(r"/\d{8}-\d{6}/?$")


def bucket_scheme(value: object) -> str | None:
    """``s3``/``gcs`` (the uploader type) when ``value`` is a URI of such a bucket."""
    if not isinstance(value, str) or "://" not in value:
        return None
    scheme = value.split("://", 1)[0]
    for kind, like in (("s3", schemes_like("s3")), ("gcs", schemes_like("gs"))):
        if scheme in like:
            return kind
    return None


def as_written(uri: str) -> str:
    """``uri`` without the timestamp ROLL's BaseConfig appended to it."""
    return ROLL_TIMESTAMP.sub("", uri)


def file_system_or_bucket(original: Callable[..., Any]) -> Callable[..., Any]:
    """ROLL's ``file_system`` uploader class ``original``, except that an ``output_dir``
    on a bucket builds cloudckpt's uploader for it (ROLL calls ``cls(**config)``)."""
    original = getattr(original, "_cloudckpt_original", original)

    def build(*args: Any, **kwargs: Any) -> Any:
        output_dir = kwargs.get("output_dir", args[0] if args else None)
        kind = bucket_scheme(output_dir)
        if kind is None:
            return original(*args, **kwargs)
        from cloudckpt.integrations.roll.uploader import GcsUploader, S3Uploader

        kwargs.pop("type", None)
        kwargs["output_dir"] = as_written(str(output_dir))
        cls = S3Uploader if kind == "s3" else GcsUploader
        return cls(*args[1:], **kwargs)

    build._cloudckpt_original = original  # type: ignore[attr-defined]
    build.__name__ = build.__qualname__ = "FileSystemOrBucketUploader"
    return build
