"""How long the ``cloudckpt`` command takes: start-up, and ``ls`` of a large run root.

    python benchmarks/cli_bench.py [--repeat 5] [--checkpoints 300] [--others 2000]

Each figure is the median wall time of ``--repeat`` runs of a fresh process, beside
``python -c pass`` measured in the same run. Targets: ``cloudckpt --version`` and
``cloudckpt ls`` of a local root of 3 checkpoints each at most 1.0 s more than
``python -c pass``; ``cloudckpt ls`` of a root holding ``--checkpoints`` committed
checkpoints and ``--others`` objects cloudckpt did not write (moto S3 on 127.0.0.1)
within 1.5 s, reading the root index (written by the first ``ls``, which finds none:
the checkpoints are written by ``CheckpointWriter`` alone); ``cloudckpt ls --no-index``
of the same root, which reads every manifest, is measured beside it. Requests ``ls``
made are counted through a logging proxy, and the floor the server sets without an
index is measured beside it: plain boto3 reading the same manifests with 16 threads,
and listing the root's prefixes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from cloudckpt_testkit import FaultProxy, MotoServer

from cloudckpt import CheckpointWriter, list_checkpoints


def median_seconds(cmd: list[str], repeat: int, env: dict[str, str]) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True, env=env)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def fill(root: str, options: dict, checkpoints: int, others: int) -> None:
    """``checkpoints`` small committed checkpoints, and ``others`` objects of a user's
    (logs) under the same root."""
    def one(i: int) -> None:
        with CheckpointWriter(f"{root}/step-{i}", step=i, storage_options=options) as w:
            w.put("model.bin", b"x" * 1000)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(checkpoints)))
    import boto3

    s3 = boto3.client("s3", endpoint_url=options["endpoint_url"], region_name="us-east-1",
                      aws_access_key_id=options["key"], aws_secret_access_key=options["secret"])
    bucket, _, prefix = root.removeprefix("s3://").partition("/")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: s3.put_object(Bucket=bucket, Key=f"{prefix}/logs/{i}.txt",
                                              Body=b"log line\n"), range(others)))


def floor_seconds(root: str, options: dict, checkpoints: int) -> float:
    """What the server alone costs: the delimiter listing and every manifest, fetched
    with plain boto3 over 16 threads (no cloudckpt, no process start)."""
    import boto3
    import botocore.config

    s3 = boto3.client("s3", endpoint_url=options["endpoint_url"], region_name="us-east-1",
                      aws_access_key_id=options["key"], aws_secret_access_key=options["secret"],
                      config=botocore.config.Config(max_pool_connections=16))
    bucket, _, prefix = root.removeprefix("s3://").partition("/")
    t0 = time.perf_counter()
    s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/", Delimiter="/")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: s3.get_object(
            Bucket=bucket, Key=f"{prefix}/step-{i}/cloudckpt-manifest.json")["Body"].read(),
            range(checkpoints)))
    return time.perf_counter() - t0


def in_process(root: str, options: dict, index: bool) -> float:
    """One ``ls``'s listing alone, in this process (no interpreter start, no imports):
    ``list_checkpoints(..., include_uncommitted=True)`` with or without the index."""
    t0 = time.perf_counter()
    list_checkpoints(root, options, include_uncommitted=True, index=index)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--checkpoints", type=int, default=300)
    p.add_argument("--others", type=int, default=2000)
    args = p.parse_args()
    cli = [sys.executable, "-m", "cloudckpt"]
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp, MotoServer() as server:
        local = os.path.join(tmp, "run")
        for i in range(3):
            with CheckpointWriter(f"{local}/step-{i}", step=i) as w:
                w.put("model.bin", b"x" * 1000)
        server.create_bucket("bench")
        options = server.storage_options()
        root = "s3://bench/run"
        fill(root, options, args.checkpoints, args.others)
        with FaultProxy(server.endpoint) as proxy:
            s3_env = {**env, **server.env(), "AWS_ENDPOINT_URL": proxy.endpoint}
            base = median_seconds([sys.executable, "-c", "pass"], args.repeat, env)
            version = median_seconds([*cli, "--version"], args.repeat, env)
            ls_local = median_seconds([*cli, "ls", local], args.repeat, env)
            subprocess.run([*cli, "ls", root], check=True, capture_output=True, env=s3_env)
            proxy.reset_counters()
            ls_s3 = median_seconds([*cli, "ls", root], args.repeat, s3_env)
            per_ls = {m: n // args.repeat for m, n in proxy.requests_by_method.items()}
            proxy.reset_counters()
            no_index = median_seconds([*cli, "ls", "--no-index", root], args.repeat, s3_env)
            per_no_index = {m: n // args.repeat for m, n in proxy.requests_by_method.items()}
        listing = {index: statistics.median(in_process(root, options, index)
                                            for _ in range(args.repeat))
                   for index in (True, False)}
        floor = statistics.median(floor_seconds(root, options, args.checkpoints)
                                  for _ in range(args.repeat))
    print(f"python -c pass                         {base:6.2f} s")
    print(f"cloudckpt --version                    {version:6.2f} s  (+{version - base:.2f} s; "
          "target <= +1.0)")
    print(f"cloudckpt ls, local root, 3 ckpts      {ls_local:6.2f} s  (+{ls_local - base:.2f} s; "
          "target <= +1.0)")
    print(f"cloudckpt ls, S3, {args.checkpoints} ckpts + {args.others} others "
          f"{ls_s3:6.2f} s  (target <= 1.5); requests per ls: {per_ls}")
    print(f"cloudckpt ls --no-index, the same root    {no_index:6.2f} s  (every manifest read; "
          f"ls with the index is {no_index / ls_s3:.1f}x faster); requests per ls: "
          f"{per_no_index}")
    print(f"   the listing alone, in process: {listing[True]:.3f} s with the index, "
          f"{listing[False]:.3f} s without")
    print(f"   the server's floor without an index: the same listing and {args.checkpoints} "
          f"manifest GETs with plain boto3, 16 threads: {floor:.2f} s")
    ok = version - base <= 1.0 and ls_local - base <= 1.0 and ls_s3 <= 1.5
    print("targets met" if ok else "TARGETS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
