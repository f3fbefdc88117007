"""Partner copies in the local tier: a lost node's ranks resume from their partners.

4 gloo ranks as 2 "nodes": each node is one torchrun (``--nnodes 2``) started in a
pid and UTS namespace of its own (:func:`cloudckpt_testkit.nodes.as_node`: its own
hostname, its own ``TMPDIR``), with its own local-tier directory. With
``LocalTier(replicas=1)``, rank ``r`` of node A copies each local step to rank ``r``
of node B and the other way round. Wiping a node's directory stands for a replaced
node; the relaunch goes through a request-logging proxy, which tells what the
resume read from the bucket.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cloudckpt_testkit import FaultProxy
from cloudckpt_testkit.nodes import as_node, check_unshare, node_env
from dist_run import free_port
from test_resume import EXAMPLE, assert_same_params, assert_same_run, env
from training_runs import explain, kill_tree, losses

from cloudckpt import ConfigError, LocalTier
from cloudckpt.core.listing import list_checkpoints
from cloudckpt.storage import open_store
from cloudckpt.training.replicas import partners

STEPS = 12
#: Local saves at steps 1, 3, 5, 7, 9, 11, each copied to the partner; every 2nd
#: drained: 3, 7, 11.
TIER_ARGS = ("--every", "0", "--local-every", "2", "--drain-every", "2", "--replicas", "1")
NODES = ("node-a", "node-b")


def _commands(options_json: str, root: str, base: Path, *extra: str) -> list[list[str]]:
    port = free_port()
    return [as_node([sys.executable, "-m", "torch.distributed.run", "--nnodes=2",
                     f"--node_rank={i}", "--nproc_per_node=2", "--master_addr=127.0.0.1",
                     f"--master_port={port}", EXAMPLE, "--root", root, "--storage-options",
                     options_json, "--steps", str(STEPS), "--local-dir",
                     str(base / host / "tier"), *TIER_ARGS, *extra], host)
            for i, host in enumerate(NODES)]


#: How many times each test's job was launched: a relaunch is the run's next attempt,
#: as a scheduler's requeue says (``SLURM_RESTART_COUNT``), so what the killed attempt
#: left claimed is taken over at once instead of after its lease.
_attempts: dict[Path, int] = {}


def _start(cmds: list[list[str]], backend_env: dict, base: Path) -> list[subprocess.Popen]:
    attempt = _attempts[base] = _attempts.get(base, -1) + 1
    run = {"CLOUDCKPT_RUN_ID": f"replicas-{abs(hash(base))}", "CLOUDCKPT_RUN_ATTEMPT": str(attempt)}
    return [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=node_env(base, host, {**backend_env, **run}),
                             start_new_session=True)
            for cmd, host in zip(cmds, NODES, strict=True)]


def run_job(cmds: list[list[str]], backend_env: dict, base: Path) -> str:
    """Both nodes to the end; node A's stdout (rank 0 prints the steps)."""
    procs = _start(cmds, backend_env, base)
    outs = [p.communicate(timeout=400) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, explain(subprocess.CompletedProcess(p.args, p.returncode,
                                                                      out, err))
    assert "done" in outs[0][0]
    return outs[0][0]


def run_until(cmds: list[list[str]], backend_env: dict, base: Path, step: int,
              copies_of: int) -> str:
    """Start both nodes; once rank 0 printed ``step`` and every rank's copy of local
    step ``copies_of`` is committed on the other node, SIGKILL both nodes."""
    procs = _start(cmds, backend_env, base)
    seen = []
    assert procs[0].stdout is not None
    for line in procs[0].stdout:
        seen.append(line)
        if line.startswith(f"step {step} "):
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and not all(
                    copy_committed(base, r, copies_of) for r in range(4)):
                time.sleep(0.05)
            break
    for p in procs:
        kill_tree(p.pid)
        p.wait(timeout=60)
    assert f"step {step} " in "".join(seen), "".join(seen) + procs[0].stderr.read()[-3000:]
    return "".join(seen)


def run_crashing(cmds: list[list[str]], backend_env: dict, base: Path) -> str:
    """Both nodes until a rank says it crashes mid-replication; then both are killed
    (the other node's ranks fail or hang on the dead peer: a job that lost a rank)."""
    procs = _start(cmds, backend_env, base)
    seen = []
    assert procs[0].stdout is not None and procs[1].stdout is not None
    deadline = time.monotonic() + 300
    import selectors

    sel = selectors.DefaultSelector()
    for p in procs:
        sel.register(p.stdout, selectors.EVENT_READ)
    crashed = False
    while not crashed and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=1):
            line = key.fileobj.readline()  # type: ignore[union-attr]
            if line:
                seen.append(line) if key.fileobj is procs[0].stdout else None
                crashed = crashed or "crashing mid-replication" in line
    for p in procs:
        kill_tree(p.pid)
        p.wait(timeout=60)
    assert crashed, "".join(seen)
    return "".join(seen)


def copy_committed(base: Path, rank: int, step: int) -> bool:
    """Whether rank ``rank``'s local step ``step`` is committed as a copy on the other node."""
    other = NODES[1 - rank // 2]
    return (base / other / "tier" / "replicas" / f"rank-{rank:05d}" / f"step-{step}" /
            "cloudckpt-manifest.json").exists()


def own_steps(base: Path, rank: int) -> list[int]:
    d = base / NODES[rank // 2] / "tier" / f"rank-{rank:05d}"
    return sorted(int(p.name.split("-")[1]) for p in d.iterdir()
                  if (p / "cloudckpt-manifest.json").exists()) if d.exists() else []


def committed(backend, root: str) -> list[int]:
    return [c.step for c in list_checkpoints(open_store(root, backend.options)) if c.committed]


class _OnDisk:
    options: dict = {}

    def options_json(self) -> str:
        return "{}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same 2-node job, never stopped: its losses and final parameters."""
    check_unshare()
    tmp = tmp_path_factory.mktemp("replica-ref")
    out = run_job(_commands("{}", str(tmp / "bucket"), tmp / "nodes", "--out",
                            str(tmp / "ref.pt")), env(_OnDisk()), tmp / "nodes")
    assert sorted(losses(out)) == list(range(STEPS))
    return losses(out), tmp / "ref.pt"


def _bucket_reads(proxy: FaultProxy, root: str) -> list[str]:
    """The GETs and HEADs the relaunch sent for objects of checkpoints in the root."""
    prefix = "/" + root.split("://", 1)[1].split("/", 1)[1] + "/step-"
    return [f"{r.method} {r.target}" for r in proxy.request_log
            if r.method in ("GET", "HEAD") and prefix in r.target.split("?")[0]]


def copies_on(base: Path, node: str, rank: int) -> list[int]:
    d = base / node / "tier" / "replicas" / f"rank-{rank:05d}"
    return sorted(int(p.name.split("-")[1]) for p in d.iterdir()
                  if (p / "cloudckpt-manifest.json").exists()) if d.exists() else []


def test_a_lost_node_resumes_from_its_partners_copies_reading_nothing_from_the_bucket(
        s3, s3_server, tmp_path, reference):
    ref_losses, ref_params = reference
    root, base = s3.uri("lost-node"), tmp_path / "nodes"
    first = run_until(_commands(s3.options_json(), root, base), env(s3), base, step=10,
                      copies_of=9)
    shutil.rmtree(base / "node-b")  # node B replaced: ranks 2 and 3 lost everything
    # What every rank can still get locally: ranks 0 and 1 their own steps, ranks 2 and 3
    # node A's copies of theirs (9 at least: the run was killed once they were committed).
    held = [own_steps(base, 0), own_steps(base, 1), copies_on(base, "node-a", 2),
            copies_on(base, "node-a", 3)]
    step = max(set.intersection(*map(set, held)))
    assert step >= 9 and step >= max(committed(s3, root))

    with FaultProxy(s3_server.endpoint) as proxy:  # resume only (no step to train)
        opts = json.dumps({**json.loads(s3.options_json()), "endpoint_url": proxy.endpoint})
        out = run_job(_commands(opts, root, base, "--steps", "0"), env(s3), base)
        assert f"resumed at step {step + 1}" in out
        # The bucket was listed (does it hold a newer step?); no checkpoint was read.
        assert not _bucket_reads(proxy, root), _bucket_reads(proxy, root)
        assert any(r.method == "GET" and "list-type=2" in r.target for r in proxy.request_log)
    # Ranks 2 and 3 hold the fetched step in their own tier again, committed.
    assert step in own_steps(base, 2) and step in own_steps(base, 3)

    resumed = run_job(_commands(s3.options_json(), root, base, "--out", str(tmp_path / "a.pt")),
                      env(s3), base)
    assert f"resumed at step {step + 1}" in resumed
    assert_same_run(ref_losses, first, resumed)
    assert_same_params(ref_params, tmp_path / "a.pt")


def test_with_both_copies_gone_the_job_resumes_from_the_bucket(s3, tmp_path, reference):
    ref_losses, ref_params = reference
    root, base = s3.uri("both-gone"), tmp_path / "nodes"
    first = run_until(_commands(s3.options_json(), root, base), env(s3), base, step=10,
                      copies_of=9)
    bucket = committed(s3, root)
    shutil.rmtree(base / "node-b")  # rank 2's own copy...
    shutil.rmtree(base / "node-a" / "tier" / "replicas" / "rank-00002")  # ...and its partner's

    resumed = run_job(_commands(s3.options_json(), root, base, "--out", str(tmp_path / "b.pt")),
                      env(s3), base)
    assert f"resumed at step {max(bucket) + 1}" in resumed
    assert_same_run(ref_losses, first, resumed)
    assert_same_params(ref_params, tmp_path / "b.pt")


@pytest.mark.parametrize(("point", "rank", "wipe"), [
    ("write", 2, "node-b"),    # the receiver dies mid-stream; its node is then replaced
    ("write", 0, "node-b"),    # a sender's partner dies; the sender's node survives
    ("commit", 1, None),       # all bytes in, the copy never committed; nodes survive
    ("commit", 3, "node-a"),   # the same, then the other node is replaced
])
def test_sigkill_mid_replication_resumes_bit_exact(s3, tmp_path, reference, point, rank, wipe):
    ref_losses, ref_params = reference
    root, base = s3.uri(f"kill-{point}-{rank}"), tmp_path / "nodes"
    crash = run_crashing(_commands(s3.options_json(), root, base, "--crash-mid-replication", "9",
                                   "--crash-replication-point", point,
                                   "--crash-replication-rank", str(rank)), env(s3), base)
    assert not copy_committed(base, rank - 2 if rank >= 2 else rank + 2, 9)
    if wipe:
        shutil.rmtree(base / wipe)

    resumed = run_job(_commands(s3.options_json(), root, base, "--out", str(tmp_path / "c.pt")),
                      env(s3), base)
    started = int(resumed.split("resumed at step ")[1].split()[0])
    assert started >= 8  # step 7 at worst: every rank holds it, or the bucket does
    assert_same_run(ref_losses, crash, resumed)
    assert_same_params(ref_params, tmp_path / "c.pt")


def test_partners_are_the_same_local_rank_on_the_next_nodes():
    hosts = ["a", "a", "b", "b", "c", "c"]
    assert partners(hosts, 1) == [[2], [3], [4], [5], [0], [1]]
    assert partners(hosts, 2) == [[2, 4], [3, 5], [4, 0], [5, 1], [0, 2], [1, 3]]
    with pytest.raises(ConfigError, match="at least 3 nodes"):
        partners(["a", "b"], 2)
    with pytest.raises(ConfigError, match="as many ranks on every node"):
        partners(["a", "a", "b"], 1)
    with pytest.raises(ConfigError, match="replicas"):
        LocalTier("/tmp/x", every_steps=1, replicas=-1)
    assert torch.equal(torch.tensor(partners(["x", "y"], 1)), torch.tensor([[1], [0]]))


def fetch_from_a_lost_copy(rank: int, world: int, base: str) -> str:
    """Rank 1 lacks step 3, and rank 0 says it holds a copy that is gone from its disk."""
    from cloudckpt.core.retention import Managed
    from cloudckpt.errors import CloudCkptError
    from cloudckpt.storage import as_store
    from cloudckpt.training.replicas import Held, Replicas, fetch_missing

    managed = Managed.from_format("training", "step-{step}")
    held = [Held({3: "step-3"}, {1: {3: "step-3"}}), Held({}, {})]
    copies = Replicas(f"{base}/node-{rank}", managed, world, fsync=False, keep_last=2)
    own = as_store(f"{base}/node-{rank}/rank-{rank:05d}")
    try:
        fetch_missing(3, held, rank, own, copies, None)
    except CloudCkptError as exc:
        return type(exc).__name__
    return "no error"


def test_a_copy_the_holder_cannot_read_fails_the_fetch_on_both_ranks_without_a_hang(tmp_path):
    """The holder's own error (its copy is gone) is raised on both ranks, promptly: the
    receiver gets an empty stream instead of waiting for one."""
    from dist_run import run_ranks

    got = run_ranks("test_replicas.fetch_from_a_lost_copy", 2, str(tmp_path), timeout=120)
    assert got == {0: "CheckpointNotFoundError", 1: "CheckpointNotFoundError"}, got
