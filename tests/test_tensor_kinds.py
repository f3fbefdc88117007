"""Which tensors a DCP state may hold: dense ones are saved as their values; a sparse,
nested, meta or quantized one, which no load could give back, is refused with a
ConfigError naming its key and what to save instead, on every rank, before anything
reaches the bucket (no claim, no object)."""

from __future__ import annotations

import warnings

import pytest
import torch

import cloudckpt.dcp as cdcp
from cloudckpt import CheckpointManager, ConfigError, ManagerOptions, StepInfo, open_store

BASE = torch.arange(12.0).reshape(3, 4)

#: Each unsupported kind, and what its refusal must say about it.
UNSUPPORTED = {
    "sparse_coo": (lambda: BASE.to_sparse(), r"layout torch\.sparse_coo.*to_dense\(\)"),
    "sparse_csr": (lambda: BASE.to_sparse_csr(), r"layout torch\.sparse_csr.*crow_indices"),
    "nested": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
               r"a nested tensor.*unbind\(\)"),
    "meta": (lambda: torch.empty(3, 4, device="meta"), r"a meta tensor: it has no data"),
    "quantized": (lambda: torch.quantize_per_tensor(BASE, 0.1, 0, torch.quint8),
                  r"a quantized tensor.*scale and zero point.*dequantize\(\)"),
}


def dcp_save(s3, state):
    cdcp.save(state, s3.uri("dcp", "step-1"), storage_options=s3.options, step=1)


def async_dcp_save(s3, state):
    cdcp.async_save(state, s3.uri("dcp", "step-1"), storage_options=s3.options,
                    step=1).result()


def manager_save(s3, state):
    mgr = CheckpointManager(s3.uri("run"), ManagerOptions(every_steps=1),
                            storage_options=s3.options)
    try:
        mgr.save(StepInfo(), state)
    finally:
        mgr.close()


SAVES = {"dcp.save": dcp_save, "dcp.async_save": async_dcp_save, "manager": manager_save}


@pytest.mark.parametrize("save", sorted(SAVES))
@pytest.mark.parametrize("kind", sorted(UNSUPPORTED))
def test_an_unsupported_tensor_is_refused_before_anything_is_written(s3, kind, save):
    make, says = UNSUPPORTED[kind]
    state = {"model": {"layer.weight": torch.ones(4), "layer.odd": make()}}
    with pytest.raises(ConfigError) as refused:
        SAVES[save](s3, state)
    message = str(refused.value)
    assert message.startswith("state_dict['model.layer.odd'] is "), message
    assert refused.match(says) and message.endswith("Nothing was saved.")
    assert open_store(s3.root, s3.options).list() == []  # no claim, no object


def test_a_sparse_tensor_on_one_rank_stops_every_rank_before_anything_is_written(
        s3, tmp_path):
    from dist_run import run_ranks

    results = run_ranks("mistake_workers.refuse_a_sparse_tensor_on_one_rank", 2, s3.root,
                        s3.options_json(), timeout=180, pg_timeout=90)
    for rank in (0, 1):
        assert [name for name, _ in results[rank]] == ["ConfigError", "ConfigError"], rank
        for _, message in results[rank]:
            assert "state_dict['model.w'] is a tensor of layout torch.sparse_coo" in message
            assert ("rank 1: " in message) == (rank == 0), message
    assert open_store(s3.root, s3.options).list() == []


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_a_conjugate_or_negative_view_is_saved_as_its_values(s3, view):
    """Such a view shares the bytes of another tensor and flips them on reading: what
    is saved is what it reads as, not the bytes beneath."""
    z = torch.complex(BASE, BASE + 1)
    value = z.conj() if view == "conj" else torch._neg_view(BASE)
    assert (value.is_conj() if view == "conj" else value.is_neg())
    uri = s3.uri("dcp", view)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cdcp.save({"v": value}, uri, storage_options=s3.options)
        back = {"v": torch.zeros_like(value.resolve_conj().resolve_neg())}
        cdcp.load(back, uri, storage_options=s3.options)
    assert torch.equal(back["v"], value.resolve_conj().resolve_neg())
