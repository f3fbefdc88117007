"""RLinf 0.3.0's own code, unchanged, under ``cloudckpt run`` and without it:

- ``FSDPStrategyBase.save_checkpoint`` / ``load_checkpoint`` (FSDP2, 2 gloo ranks on
  CPU, rlinf_strategy_ranks.py): a bucket path commits the part there and resumes it
  bit-exact; without activation RLinf writes its local directory exactly as before;
- ``ReasoningRunner._save_checkpoint`` and ``init_workers`` with ``resume_dir: auto``
  (rlinf_runner_driver.py): with ``runner.output_dir`` in the bucket, one committed step
  holding the parts and ``data/data.pt``, resumed with the dataloader's position.

RLinf 0.3.0's ``local_shard`` format saves, but its own load fails on an FSDP2 model
(``Checkpoint.load_state_dict`` hands the local shards to ``model.load_state_dict``:
a size mismatch per sharded parameter), on local disk as on a bucket: the
comparisons after a load are made for ``dcp`` only, and for ``local_shard`` the test
checks that the failure is RLinf's own, the same with and without cloudckpt.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from cloudckpt import open_checkpoint
from cloudckpt.names import DCP_INDEX_NAME

HERE = Path(__file__).resolve().parent
RLINF_LOAD_BUG = ("RLinf load_checkpoint raised RuntimeError: Error(s) in loading state_dict "
                  "for FSDPSequential: size mismatch")


def run_ranks(root: str, out: Path, env: dict[str, str], *, activate: bool
              ) -> tuple[dict[str, list[dict]], str]:
    launch = [sys.executable, str(HERE / "rlinf_strategy_ranks.py"), "--dir", root,
              "--format", "dcp,local_shard", "--out", str(out)]
    if activate:
        launch = [sys.executable, "-m", "cloudckpt", "run", "--", *launch]
    r = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 1), r.stderr[-4000:]  # 1: a check failed, read the reports
    reports = {fmt: [json.loads((out / f"rank{rank}-{fmt}.json").read_text())
                     for rank in range(2)] for fmt in ("dcp", "local_shard")}
    for rank_reports in reports.values():
        for rep in rank_reports:
            assert rep["strategy"] == "FSDP2Strategy" and "site-packages" in rep["rlinf"]
    return reports, r.stderr


def assert_rlinf_outcome(reports: dict[str, list[dict]]) -> None:
    for rep in reports["dcp"]:  # saved, loaded into a fresh strategy, trained on: equal
        assert rep["problems"] == [] and rep["tensors_checked"] > 30, rep
    for rep in reports["local_shard"]:  # saved bit-exact; RLinf's own load fails
        assert len(rep["problems"]) == 1 and rep["problems"][0].startswith(RLINF_LOAD_BUG), rep


def test_rlinf_strategy_commits_and_resumes_a_step_in_the_bucket(s3, tmp_path):
    env = {**os.environ, **s3.env}  # the script takes the PyPI rlinf, not the peers' copy
    reports, stderr = run_ranks(s3.root, tmp_path / "out", env, activate=True)
    assert_rlinf_outcome(reports)
    for rep in reports["dcp"]:  # a copy under a newer step is refused, nothing loaded
        assert "named for step 5 but its manifest says step 2" in rep["refused"]["error"]
    # One line on each rank: what it bound first, and the strategy's module, bound at
    # its import (the commits below are its work).
    said = re.findall(r"bound the rlinf integration into rlinf 0\.3\.0, pid \d+: (.*)", stderr)
    assert len(said) == 2 and all(
        "rlinf.hybrid_engines.fsdp.strategy.base" in line for line in said), stderr
    dcp = open_checkpoint(f"{s3.root}/dcp/global_step_2/actor", s3.options)
    dcp.verify(deep=True)
    assert dcp.manifest.kind == "rlinf-part" and dcp.step == 2
    # RLinf's files, and the indexed format's index and records beside its .metadata
    assert set(dcp.files) == {"dcp_checkpoint/.metadata", "dcp_checkpoint/__0_0.distcp",
                              "dcp_checkpoint/__1_0.distcp",
                              "dcp_checkpoint/__0_records", "dcp_checkpoint/__1_records",
                              f"dcp_checkpoint/{DCP_INDEX_NAME}",
                              "dcp_checkpoint/cloudckpt-manifest.json",
                              "model_state_dict/full_weights.pt"}
    shard = open_checkpoint(f"{s3.root}/local_shard/global_step_2/actor", s3.options)
    shard.verify(deep=True)
    assert set(shard.files) == {"local_shard_checkpoint/checkpoint_rank_0.pt",
                                "local_shard_checkpoint/checkpoint_rank_1.pt",
                                "model_state_dict/full_weights.pt"}


def test_without_activation_rlinf_writes_its_local_directory_as_before(tmp_path):
    root = tmp_path / "run"
    reports, stderr = run_ranks(str(root), tmp_path / "out", dict(os.environ), activate=False)
    assert_rlinf_outcome(reports)
    assert "bound the rlinf integration" not in stderr
    files = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    assert files == {"dcp/global_step_2/actor/dcp_checkpoint/.metadata",
                     "dcp/global_step_2/actor/dcp_checkpoint/__0_0.distcp",
                     "dcp/global_step_2/actor/dcp_checkpoint/__1_0.distcp",
                     "dcp/global_step_2/actor/model_state_dict/full_weights.pt",
                     "local_shard/global_step_2/actor/local_shard_checkpoint/checkpoint_rank_0.pt",
                     "local_shard/global_step_2/actor/local_shard_checkpoint/checkpoint_rank_1.pt",
                     "local_shard/global_step_2/actor/model_state_dict/full_weights.pt"}


def run_runner(output_dir: str, out: Path, env: dict[str, str], *, activate: bool
               ) -> tuple[dict, dict, str]:
    out.mkdir()
    launch = [sys.executable, str(HERE / "rlinf_runner_driver.py"), "--output-dir", output_dir,
              "--out", str(out)]
    if activate:
        launch = [sys.executable, "-m", "cloudckpt", "run", "--", *launch]
    r = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    saved, resumed = (json.loads((out / f"{p}.json").read_text()) for p in ("save", "resume"))
    return saved, resumed, r.stderr


def assert_resumed(saved: dict, resumed: dict) -> None:
    assert resumed["global_steps"] == saved["global_steps"] == 2
    assert resumed["resume_dir"].rstrip("/").endswith("exp/checkpoints/global_step_2")
    assert resumed["state"] == saved["state"]  # model, optimizer, scheduler, RNG: bit-exact
    assert resumed["next_batch"] == saved["next_batch"]  # the dataloader went on


def test_rlinf_runner_commits_its_step_and_resumes_auto_from_the_bucket(s3, tmp_path):
    """RLinf's own ReasoningRunner._save_checkpoint and init_workers (resume_dir: auto),
    runner.output_dir in the bucket: one committed step with the actor's part and
    data/data.pt; the resume finds it, loads the part and the dataloader position."""
    saved, resumed, stderr = run_runner(s3.root, tmp_path / "out", {**os.environ, **s3.env},
                                        activate=True)
    assert_resumed(saved, resumed)
    assert resumed["resume_dir"] == f"{s3.root}/exp/checkpoints/global_step_2"
    step = open_checkpoint(resumed["resume_dir"], s3.options)
    step.verify(deep=True)
    assert step.manifest.kind == "rlinf" and step.step == 2
    assert {"data/data.pt", "actor/cloudckpt-manifest.json",
            "actor/dcp_checkpoint/.metadata", "actor/model_state_dict/full_weights.pt"
            } <= set(step.files)
    assert "RLinf step 2 committed" in stderr and "dataloader state loaded from" in stderr


def test_without_activation_rlinf_runner_saves_and_resumes_locally_as_before(tmp_path):
    root = tmp_path / "results"
    saved, resumed, stderr = run_runner(str(root), tmp_path / "out", dict(os.environ),
                                        activate=False)
    assert_resumed(saved, resumed)  # RLinf's own, from its local directory
    assert (root / "exp/checkpoints/global_step_2/data/data.pt").is_file()
    assert not list(root.rglob("cloudckpt-manifest.json")) and "bound the rlinf" not in stderr
