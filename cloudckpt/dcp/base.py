"""What the DCP writer and reader share: a store, its URI, URI validation."""

from __future__ import annotations

from typing import Any

from cloudckpt.storage import Store, can_open


class OnStore:
    """What the writer and the reader share: a store, its URI, URI validation."""

    store: Store

    @property
    def uri(self) -> str:
        return self.store.uri

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Whether these classes can open ``checkpoint_id``: a local path, or a URL whose
        scheme has a cloudckpt backend (``s3://``, ``gs://``, ``az://``, ``memory://``,
        a registered one, or one fsspec knows); not ``abc://x``."""
        return can_open(checkpoint_id)
