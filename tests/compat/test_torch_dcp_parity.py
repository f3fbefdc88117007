"""PyTorch's own DCP tests, as cloudckpt's: the scenarios of pytorch/pytorch's
``test/distributed/checkpoint/test_file_system_checkpoint_cpu.py`` and
``test/distributed/checkpoint/e2e/test_e2e_save_and_load.py`` (read at main's commits
02dee1ad31d013c458c5071f1710da10a2d50392 and 01357535d7c74848ba16d36179c2df92559e75ba;
the torch under test is 2.13.0, release commit cf30153c4c131c8164ee7798e5022d810682e2cb),
written anew. Each runs twice with the same assertions: with torch's
``FileSystemWriter``/``FileSystemReader`` on a temporary directory and with cloudckpt's
``CloudStorageWriter``/``CloudStorageReader`` on S3 (moto over HTTP), on real gloo ranks;
both must pass.

Adapted to CPU ranks: the models are trained on CPU, FSDP is FSDP2 (``fully_shard``) and
HSDP its 2-D mesh, on gloo. Left out, for want of CUDA on these ranks: the async variants
with pinned, non-blocking or cached staging (``cache_staged_state_dict=True`` pins its
copy, which torch refuses without a GPU, with its writer and ours alike), ``torch.compile``
of the models, and the NCCL-only check. The upstream ``save(..., checkpoint_id=path)``
calls pass the place's writer and reader: torch picks its own writers from a
``checkpoint_id`` and takes no others (see docs/dcp.md). The one intended difference:
a stream transform (``_extensions``), which torch's writer applies and cloudckpt's
refuses with a ``ConfigError`` before anything is written.
"""

from __future__ import annotations

from typing import Any

from dcp_parity_ranks import CLOUDCKPT, TORCH, run
from dist_run import run_ranks

from cloudckpt.storage import open_store


def places(s3: Any, tmp_path: Any) -> list[list[str]]:
    return [[TORCH, str(tmp_path / "torch"), "{}"],
            [CLOUDCKPT, s3.uri("parity"), s3.options_json()]]


def assert_alike(per_rank: dict[int, dict[str, str]], names: list[str]) -> None:
    """Every scenario passed with torch's writer and with cloudckpt's, on every rank."""
    expected = {f"{n}/{k}" for n in names for k in (TORCH, CLOUDCKPT)}
    failed = {}
    for rank, results in per_rank.items():
        assert set(results) == expected, f"rank {rank} ran {sorted(results)}"
        failed.update({f"rank {rank}: {k}": v for k, v in results.items() if v != "ok"})
    assert not failed, "\n\n".join(f"{k} failed:\n{v}" for k, v in sorted(failed.items()))


ONE_PROCESS = ["round_trip:1", "round_trip:2", "dtype_cast", "stateful_in_place",
               "empty_state", "init_state_dict"]


def test_single_process_scenarios_pass_alike(s3, tmp_path) -> None:
    assert_alike({0: run(0, 1, ONE_PROCESS, places(s3, tmp_path))}, ONE_PROCESS)


def test_a_stream_transform_is_applied_by_torch_s_writer_and_refused_by_cloudckpt_s(
        s3, tmp_path) -> None:
    results = run(0, 1, ["stream_transform"], places(s3, tmp_path))
    assert results[f"stream_transform/{TORCH}"] == "ok"
    refused = results[f"stream_transform/{CLOUDCKPT}"]
    assert "ConfigError: _extensions=" in refused and "stream transforms" in refused
    assert open_store(s3.uri("parity"), s3.options).list(internal=True) == []


TWO_RANKS = ["sharded_round_trip:1", "sharded_round_trip:2", "reshard", "rows_to_columns",
             "plain_values", "sharded_and_plain_swap", "e2e:ddp", "e2e:fsdp",
             "e2e:fsdp-thread", "e2e:fsdp-writer-stages", "e2e:fsdp-process",
             "partial_load", "key_order", "overwrite"]


def test_two_gloo_ranks_pass_alike(s3, tmp_path) -> None:
    results = run_ranks("dcp_parity_ranks.run", 2, TWO_RANKS, places(s3, tmp_path),
                        timeout=280, pg_timeout=120)
    assert_alike(results, TWO_RANKS)


def test_hsdp_on_four_gloo_ranks_passes_alike(s3, tmp_path) -> None:
    results = run_ranks("dcp_parity_ranks.run", 4, ["e2e:hsdp"], places(s3, tmp_path),
                        timeout=280, pg_timeout=120)
    assert_alike(results, ["e2e:hsdp"])
