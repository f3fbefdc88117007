"""The Azure Blob Storage backend: its class (``backend``), how its failures are
classified (``errors``, importing no client library, so that the registry can judge
them wherever they surface) and what it makes of its storage options (``options``)."""

from cloudckpt.util.lazy import lazy_exports

__all__ = ["AzureBackend"]

__getattr__ = lazy_exports(__name__, {"backend": ["AzureBackend"]})
