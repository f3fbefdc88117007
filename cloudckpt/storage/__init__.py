"""Storage layer: one :class:`Store` interface, one module per backend."""

from cloudckpt.storage.base import (
    DEFAULT_CONCURRENCY,
    DEFAULT_PART_SIZE,
    ObjectInfo,
    ObjectWriter,
    Store,
)
from cloudckpt.storage.registry import (
    as_store,
    open_store,
    parse_options,
    register_backend,
    split_uri,
)
from cloudckpt.storage.retry import RetryPolicy, is_transient

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_PART_SIZE",
    "ObjectInfo",
    "ObjectWriter",
    "RetryPolicy",
    "Store",
    "as_store",
    "is_transient",
    "open_store",
    "parse_options",
    "register_backend",
    "split_uri",
]
