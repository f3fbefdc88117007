"""verl's parts of cloudckpt that need no verl (its own code drives the rest in
tests/compat): a step whose files include an HF export, on moto S3."""

from __future__ import annotations

import pytest

from cloudckpt import open_checkpoint, open_store
from cloudckpt.core.checkpoint import CheckpointWriter
from cloudckpt.core.ownership import OURS, survey
from cloudckpt.errors import StorageError
from cloudckpt.integrations.verl.layout import SFT_KIND
from cloudckpt.integrations.verl.workers import role_parts
from cloudckpt.names import MANIFEST_NAME
from cloudckpt.training import multipart


def test_a_step_cut_short_after_its_hf_export_committed_is_replaced_by_the_retry(
        s3, tmp_path, monkeypatch):
    """With ``hf_model`` a step holds a committed HF export at ``huggingface/``; a save
    that dies after that commit leaves the step provably cloudckpt's, so the resumed
    run's save of the same step replaces it instead of refusing the prefix."""
    (tmp_path / "huggingface").mkdir()
    (tmp_path / "huggingface" / "model.safetensors").write_bytes(b"w" * 64)
    (tmp_path / "huggingface" / "config.json").write_text("{}")
    (tmp_path / "model_world_size_1_rank_0.pt").write_bytes(b"m" * 32)
    (tmp_path / "data_0.pt").write_bytes(b"d")
    store = open_store(s3.uri("run/global_step_3"), s3.options)
    own_commit = CheckpointWriter.commit

    def cut_short(self, *args, **kwargs):
        if self.kind == SFT_KIND:
            raise StorageError("the node went away")
        return own_commit(self, *args, **kwargs)

    monkeypatch.setattr(CheckpointWriter, "commit", cut_short)
    with pytest.raises(StorageError, match="the node went away"):
        multipart.save(store, role_parts(tmp_path), step=3, kind=SFT_KIND)
    assert store.child("huggingface").exists(MANIFEST_NAME)  # the export committed
    assert not store.exists(MANIFEST_NAME) and survey(store).kind == OURS

    monkeypatch.setattr(CheckpointWriter, "commit", own_commit)
    multipart.save(store, role_parts(tmp_path), step=3, kind=SFT_KIND)
    step = open_checkpoint(store.uri, s3.options)
    step.verify(deep=True)
    assert step.manifest.kind == SFT_KIND
    assert {"huggingface/model.safetensors", "model_world_size_1_rank_0.pt",
            "data_0.pt"} <= set(step.files)
