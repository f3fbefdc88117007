"""The README's demo runs end to end against its embedded S3 server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).parent.parent / "examples" / "demo.py"


def test_demo_runs():
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    out = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "started an embedded S3 server" in out.stdout
    assert "killed with SIGKILL after step 9 (exit status -9)" in out.stdout
    assert "resumed at step 8" in out.stdout
    assert "per-step losses identical to the uninterrupted run: True" in out.stdout
    assert "final parameters identical to the uninterrupted run: True" in out.stdout
    assert "checkpoints kept (keep_last=2): ['step-15', 'step-19']" in out.stdout


def test_demo_against_an_endpoint_without_its_bucket_says_so(s3_server):
    env = {**os.environ, **s3_server.env(), "AWS_ENDPOINT_URL": s3_server.endpoint}
    s3_server.reset()  # no cloudckpt-demo bucket there
    out = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "demo: error: the bucket s3://cloudckpt-demo does not exist" in out.stderr
    assert "unset AWS_ENDPOINT_URL" in out.stderr
    assert "Traceback" not in out.stderr and "SIGKILL" not in out.stdout
