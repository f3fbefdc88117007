"""cloudckpt demo: train, crash, resume from the bucket, finish — bit-exactly.

1. trains a tiny model (examples/train_resume.py) checkpointing to s3://...,
2. kills it with SIGKILL at step 9, in the middle of the run,
3. restarts it, which resumes from the newest committed checkpoint in the bucket,
4. compares the result with a run that never crashed, and lists the bucket.

With no S3 endpoint configured (no AWS_ENDPOINT_URL and no --root), an
embedded S3 server (moto) is started on 127.0.0.1, so the demo runs anywhere.

    python examples/demo.py
    python examples/demo.py --root s3://my-bucket/demo-run     # your bucket
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch

import cloudckpt

TRAIN = str(Path(__file__).parent / "train_resume.py")
STEPS, CRASH_AT = 20, 9


class RunFailed(Exception):
    """A training run ended otherwise than it should have."""


def train(root: str, options: dict, *extra: str, expect: int = 0) -> str:
    """Run examples/train_resume.py; its stdout, once it ended with ``expect``."""
    cmd = [sys.executable, TRAIN, "--root", root, "--storage-options", json.dumps(options),
           "--steps", str(STEPS), "--every", "4", "--keep-last", "2", *extra]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != expect:
        last = (proc.stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        raise RunFailed(f"the training run failed with exit status {proc.returncode}: {last}")
    return proc.stdout


def check_bucket(root: str, options: dict) -> None:
    """Say at once when the bucket is missing or unreachable, not after a traceback."""
    try:
        cloudckpt.open_store(root, options).check_bucket()
    except cloudckpt.CloudCkptError as exc:
        where = os.environ.get("AWS_ENDPOINT_URL")
        raise RunFailed(
            f"{exc}\n   Create the bucket, pass --root s3://your-bucket/prefix"
            + (f", or unset AWS_ENDPOINT_URL (now {where}) to run against an embedded "
               "S3 server" if where else "")) from None


def losses(out: str) -> dict[int, str]:
    return {int(line.split()[1]): line.split()[3] for line in out.splitlines()
            if line.startswith("step ") and " loss " in line}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", help="where checkpoints go, e.g. s3://bucket/run "
                        "(default: an embedded S3 server)")
    args = parser.parse_args()
    try:
        return demo(args.root)
    except RunFailed as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 1


def demo(root: str | None) -> int:
    with ExitStack() as stack:
        options: dict = {}
        if root is None and not os.environ.get("AWS_ENDPOINT_URL"):
            from cloudckpt_testkit import MotoServer

            server = stack.enter_context(MotoServer())
            server.create_bucket("cloudckpt-demo")
            options = server.storage_options()
            print(f"started an embedded S3 server at {server.endpoint}")
        root = root or f"s3://cloudckpt-demo/runs/demo-{int(time.time())}"
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        check_bucket(root, options)

        print(f"\n1. training {STEPS} steps with checkpoints every 4 steps to {root}/run")
        killed = -signal.SIGKILL
        crashed = train(f"{root}/run", options, "--crash-at-step", str(CRASH_AT), expect=killed)
        print(f"   ...killed with SIGKILL after step {CRASH_AT} (exit status {killed})")

        print("\n2. what the bucket holds after the crash:")
        for info in cloudckpt.list_checkpoints(f"{root}/run", options, include_uncommitted=True):
            state = "committed" if info.committed else "uncommitted (invisible)"
            print(f"   {info.name:<10} step {info.step}  {info.files} objects  {state}")

        print("\n3. restarting: it resumes from the bucket")
        resumed = train(f"{root}/run", options, "--out", str(tmp / "resumed.pt"))
        first = next(line for line in resumed.splitlines() if line.startswith("resumed"))
        print(f"   {first}; finished with exit status 0")

        print("\n4. a reference run that never crashed")
        reference = train(f"{root}/reference", options, "--out", str(tmp / "reference.pt"))

        ref, got = losses(reference), {**losses(crashed), **losses(resumed)}
        same_losses = got == ref and len(ref) == STEPS
        a = torch.load(tmp / "resumed.pt", weights_only=True)
        b = torch.load(tmp / "reference.pt", weights_only=True)
        same_params = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

        latest = cloudckpt.latest_checkpoint(f"{root}/run", options)
        assert latest is not None
        latest.verify(deep=True)
        print("\nsummary")
        print(f"   checkpoints kept (keep_last=2): "
              f"{[c.name for c in cloudckpt.list_checkpoints(f'{root}/run', options)]}")
        print(f"   latest: {latest.uri} ({len(latest.files)} objects, verified: sizes and "
              "CRC32C)")
        print(f"   per-step losses identical to the uninterrupted run: {same_losses}")
        print(f"   final parameters identical to the uninterrupted run: {same_params}")
        return 0 if same_losses and same_params else 1


if __name__ == "__main__":
    sys.exit(main())
