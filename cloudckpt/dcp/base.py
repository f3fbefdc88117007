"""What the DCP writer and reader share: a store, its URI, URI validation."""

from __future__ import annotations

from typing import Any

from cloudckpt.errors import ConfigError
from cloudckpt.storage import Store, split_uri


def _valid_id(checkpoint_id: Any) -> bool:
    try:
        split_uri(str(checkpoint_id))
    except ConfigError:
        return False
    return True


class _OnStore:
    """What the writer and the reader share: a store, its URI, URI validation."""

    store: Store

    @property
    def uri(self) -> str:
        return self.store.uri

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return _valid_id(checkpoint_id)
