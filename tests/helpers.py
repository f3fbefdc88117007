"""Test helpers imported by name (not from ``conftest``: the suites under tests/torture
and tests/compat have their own conftest, and only one module can be ``conftest``)."""

from __future__ import annotations

from typing import Any

HUB_TOKEN = "hf_cloudckpt_test_token_0123456789"


def torn_save(uri: str, options: dict[str, Any], objects: dict[str, bytes]) -> None:
    """What a save that failed before its commit leaves behind: its objects and its
    writer's claim, marked abandoned. (Objects put there by other means are not
    cloudckpt's, and no cloudckpt command treats them as a torn save.)"""
    from cloudckpt import CheckpointWriter

    w = CheckpointWriter(uri, storage_options=options)
    w.put_many(objects)
    w.abandon()
