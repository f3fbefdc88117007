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
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "started an embedded S3 server" in out.stdout
    assert out.stdout.count("saved  s3://") == 3
    assert "verified: sizes and CRC32C of 2 objects" in out.stdout
    assert "parameters identical = True" in out.stdout
