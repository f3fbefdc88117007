"""Save and restore reports: their counts are what the bucket saw, and the figures
known at commit are in the manifest, where ``cloudckpt info`` shows them."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from cloudckpt_testkit import FaultPlan, FaultProxy

from cloudckpt import CheckpointManager, ManagerOptions, StepInfo, open_checkpoint


def test_a_reports_counts_match_what_a_request_logging_proxy_saw(s3, s3_server):
    reports = []
    with FaultProxy(s3_server.endpoint) as proxy:
        opts = {**s3.options, "endpoint_url": proxy.endpoint}
        state = {"w": torch.randn(300_000), "b": torch.randn(10)}
        mgr = CheckpointManager(s3.root, ManagerOptions(every_steps=1, keep_last=1,
                                                        on_report=reports.append),
                                storage_options=opts)
        mgr.save(StepInfo(), state)  # the first save also probes the bucket
        # Two requests of the next save are throttled once each: two retries.
        proxy.set_plan(FaultPlan(error_rate=1.0, kinds=("slowdown",), max_faults=2,
                                 match="/state/"))
        before = len(proxy.request_log)
        mgr.save(StepInfo(global_step=1), state)
        saved = reports[-1]
        assert saved.requests == len(proxy.request_log) - before
        assert saved.retries == 2 and saved.op == "save" and saved.tier == "bucket"
        assert saved.step == 1 and saved.slowest_rank == 0 and saved.blocked_s > 0

        proxy.set_plan(FaultPlan())
        before = len(proxy.request_log)
        target = {"w": torch.empty(300_000), "b": torch.empty(10)}
        CheckpointManager(s3.root, ManagerOptions(on_report=reports.append),
                          storage_options=opts).restore(target)
        restored = reports[-1]
        assert restored.op == "restore" and restored.requests == len(proxy.request_log) - before
        assert torch.equal(target["w"], state["w"])

    ckpt = open_checkpoint(s3.uri("step-1"), s3.options)
    assert (saved.bytes, saved.objects) == (ckpt.total_size, len(ckpt.files))
    at_commit = ckpt.metadata["report"]
    assert at_commit["retries"] == 2 and 0 < at_commit["requests"] < saved.requests
    info = subprocess.run([sys.executable, "-m", "cloudckpt", "info", s3.uri("step-1"),
                           "--json"], capture_output=True, text=True, env=s3_env(s3),
                          timeout=60)
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["metadata"]["report"] == at_commit


def test_a_failing_report_callback_never_fails_the_save(s3, caplog):
    def broken(report):
        raise RuntimeError("stats backend down")

    mgr = CheckpointManager(s3.root, ManagerOptions(every_steps=1, on_report=broken),
                            storage_options=s3.options)
    assert mgr.save(StepInfo(), {"w": torch.ones(4)})
    assert open_checkpoint(s3.uri("step-0"), s3.options).step == 0
    assert "the report callback failed (RuntimeError: stats backend down)" in caplog.text


def s3_env(s3) -> dict:
    import os

    return {**os.environ, **s3.env}
