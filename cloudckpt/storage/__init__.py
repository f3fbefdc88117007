"""Storage layer: one :class:`Store`, holding one of the backends (one module each;
the contract is :class:`~cloudckpt.storage.backend.Backend`)."""

from cloudckpt.storage.backend import Backend
from cloudckpt.storage.fsspec_backend import FsspecBackend
from cloudckpt.storage.objects import ObjectInfo
from cloudckpt.storage.options import DEFAULT_CONCURRENCY, DEFAULT_PART_SIZE
from cloudckpt.storage.registry import (
    as_store,
    can_open,
    is_remote,
    open_below,
    open_store,
    parse_options,
    register_backend,
    schemes_like,
    split_uri,
)
from cloudckpt.storage.retry import ONE_TRY, RetryPolicy, is_transient
from cloudckpt.storage.store import Store
from cloudckpt.storage.writers import ObjectWriter

__all__ = [
    "DEFAULT_CONCURRENCY",
    "DEFAULT_PART_SIZE",
    "Backend",
    "FsspecBackend",
    "ObjectInfo",
    "ObjectWriter",
    "ONE_TRY",
    "RetryPolicy",
    "Store",
    "as_store",
    "can_open",
    "is_transient",
    "open_below",
    "open_store",
    "parse_options",
    "register_backend",
    "schemes_like",
    "is_remote",
    "split_uri",
]
