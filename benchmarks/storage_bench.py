"""Store batch throughput versus plain s3fs, against a local S3 server (moto).

Measures, in one run and on the same objects:

* batch put: ``Store.put_many({key: bytes})`` versus s3fs's concurrent
  ``fs.pipe({path: bytes})`` (``batch_size`` = the concurrency);
* batch get: ``Store.get_many(keys)`` versus s3fs's concurrent ``fs.cat([paths])``.

Each repetition runs both sides, alternating which goes first. Every put is a
fresh write (the objects are deleted beforehand, untimed); both sides' gets read
the same objects, written once by the Store before timing starts. The best of
``--repeat`` repetitions is reported per side. Before timing, one untimed round
checks that what each side writes the other reads back byte for byte, and every
timed read is compared with the data written, so a failing side cannot pass for
a fast one.

Usage::

    python benchmarks/storage_bench.py [--objects 16] [--size-mib 16] [--repeat 3]
                                       [--concurrency 16] [--endpoint URL]

Without ``--endpoint`` a moto server is started on 127.0.0.1 for the run. The
last line printed is a JSON summary (``{"put_ratio": ..., "get_ratio": ...}``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import google_crc32c
import s3fs
from cloudckpt_testkit import MotoServer

import cloudckpt

#: Acceptance target: ours / baseline throughput, for both put and get.
TARGET_RATIO = 0.9
MB = 1_000_000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Store.put_many/get_many versus plain s3fs pipe/cat on a local S3 server."
    )
    p.add_argument("--objects", type=int, default=16, help="objects per batch (default 16)")
    p.add_argument("--size-mib", type=float, default=16.0, help="MiB per object (default 16)")
    p.add_argument("--repeat", type=int, default=3, help="repetitions; best is kept (default 3)")
    p.add_argument("--concurrency", type=int, default=16,
                   help="Store max_concurrency and s3fs batch_size (default 16)")
    p.add_argument("--endpoint", default=None,
                   help="S3 endpoint URL; default: start a moto server on 127.0.0.1")
    p.add_argument("--baseline-pool", type=int, default=None, metavar="N",
                   help="max_pool_connections of the baseline s3fs (default: botocore's, 10, "
                        "which caps its requests in flight at 10 whatever --concurrency is)")
    p.add_argument("--bucket", default="cloudckpt-bench", help="bucket (created if missing)")
    p.add_argument("--key", default=os.environ.get("AWS_ACCESS_KEY_ID", MotoServer.ACCESS_KEY),
                   help="access key for --endpoint (default $AWS_ACCESS_KEY_ID or moto's)")
    p.add_argument("--secret",
                   default=os.environ.get("AWS_SECRET_ACCESS_KEY", MotoServer.SECRET_KEY),
                   help="secret key for --endpoint (default $AWS_SECRET_ACCESS_KEY or moto's)")
    args = p.parse_args(argv)
    if args.objects < 1 or args.size_mib <= 0 or args.repeat < 1 or args.concurrency < 1:
        p.error("--objects, --size-mib, --repeat and --concurrency must be positive")
    return args


def make_payloads(n: int, size: int) -> dict[str, bytes]:
    """``n`` distinct, incompressible objects of ``size`` bytes, keyed ``obj-000``..."""
    return {f"obj-{i:03d}": os.urandom(size) for i in range(n)}


def ensure_bucket(endpoint: str, key: str, secret: str, bucket: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          aws_access_key_id=key, aws_secret_access_key=secret)
    try:
        client.head_bucket(Bucket=bucket)
    except Exception:  # noqa: BLE001 - missing (or unreadable): try to create it
        client.create_bucket(Bucket=bucket)
    finally:
        client.close()


def pool_size(fs: s3fs.S3FileSystem) -> int:
    """The botocore connection pool size of a connected s3fs filesystem."""
    return int(fs.s3.meta.config.max_pool_connections)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def check_same(what: str, got: dict[str, bytes], want: dict[str, bytes]) -> None:
    if set(got) != set(want):
        raise SystemExit(f"FAIL {what}: keys differ: {sorted(set(got) ^ set(want))[:5]}")
    for k, v in want.items():
        if got[k] != v:
            raise SystemExit(f"FAIL {what}: {k} differs ({len(got[k])} bytes read, "
                             f"{len(v)} written)")


def run(args: argparse.Namespace, endpoint: str) -> dict[str, Any]:
    bucket, prefix = args.bucket, "bench"
    size = int(args.size_mib * 1024 * 1024)
    total = args.objects * size
    ensure_bucket(endpoint, args.key, args.secret, bucket)

    store = cloudckpt.open_store(
        f"s3://{bucket}/{prefix}",
        {"endpoint_url": endpoint, "key": args.key, "secret": args.secret,
         "max_concurrency": args.concurrency},
    )
    # The baseline: s3fs as a user would make it (its own instance, its defaults).
    extra: dict[str, Any] = {}
    if args.baseline_pool:
        extra["config_kwargs"] = {"max_pool_connections": args.baseline_pool}
    fs = s3fs.S3FileSystem(endpoint_url=endpoint, key=args.key, secret=args.secret,
                           skip_instance_cache=True, **extra)
    conc = args.concurrency

    print(f"generating {args.objects} x {args.size_mib:g} MiB of random data ...", flush=True)
    data = make_payloads(args.objects, size)
    names = list(data)

    # Puts go to put/..., deleted before each one; gets read get/..., written
    # once by the Store. (How an object was written changes how fast moto and
    # botocore serve it -- e.g. whether a checksum is returned and validated --
    # so the gets must not depend on which side happened to write last.)
    def keys_of(sub: str) -> list[str]:
        return [f"{sub}/{n}" for n in names]

    def paths_of(sub: str) -> list[str]:
        return [f"{bucket}/{prefix}/{k}" for k in keys_of(sub)]

    def clear(sub: str) -> None:
        fs.rm(paths_of(sub))
        fs.invalidate_cache()

    def ours_put(sub: str = "put") -> Any:
        return store.put_many(dict(zip(keys_of(sub), data.values(), strict=True)))

    def base_put(sub: str = "put") -> Any:
        return fs.pipe(dict(zip(paths_of(sub), data.values(), strict=True)), batch_size=conc)

    def ours_get(sub: str = "get") -> dict[str, bytes]:
        got = store.get_many(keys_of(sub))
        return dict(zip(names, (got[k] for k in keys_of(sub)), strict=True))

    def base_get(sub: str = "get") -> dict[str, bytes]:
        got = fs.cat(paths_of(sub), batch_size=conc)
        return dict(zip(names, (got[p] for p in paths_of(sub)), strict=True))

    # Untimed round: each side reads back what the other wrote (also warms pools).
    print("verifying (untimed): Store put -> s3fs cat, s3fs pipe -> Store get ...", flush=True)
    clear("put")
    infos = ours_put()
    for n, k in zip(names, keys_of("put"), strict=True):
        info, v = infos[k], data[n]
        if info.size != len(v) or info.crc32c != f"{google_crc32c.value(v):08x}":
            raise SystemExit(f"FAIL Store.put_many: wrong info for {k}: {info}")
    check_same("Store put -> s3fs cat", base_get("put"), data)
    clear("put")
    base_put()
    check_same("s3fs pipe -> Store get", ours_get("put"), data)
    clear("get")
    ours_put("get")

    # Requests really in flight: capped by each client's connection pool.
    inflight_ours = min(store.max_concurrency, pool_size(store.fs))
    inflight_base = min(conc, pool_size(fs))

    best = {"put_ours": float("inf"), "put_base": float("inf"),
            "get_ours": float("inf"), "get_base": float("inf")}
    hdr = f"{'rep':>3}  {'op':<4} {'ours MB/s':>10} {'s3fs MB/s':>10} {'ratio':>6}  first"
    print(f"\n{args.objects} objects x {args.size_mib:g} MiB = {total / MB:.0f} MB per batch, "
          f"concurrency {conc}, endpoint {endpoint}\n"
          f"requests in flight at most: ours {inflight_ours} (max_concurrency "
          f"{store.max_concurrency}, pool {pool_size(store.fs)}), s3fs {inflight_base} "
          f"(batch_size {conc}, pool {pool_size(fs)})\n{hdr}", flush=True)
    for rep in range(args.repeat):
        ours_first = rep % 2 == 0
        order = ("ours", "base") if ours_first else ("base", "ours")
        secs: dict[str, float] = {}
        for side in order:
            clear("put")
            secs[f"put_{side}"], _ = timed(ours_put if side == "ours" else base_put)
        for side in order:
            secs[f"get_{side}"], got = timed(ours_get if side == "ours" else base_get)
            check_same(f"{side} get (rep {rep})", got, data)
            del got
        for op in ("put", "get"):
            mo, mb = total / secs[f"{op}_ours"] / MB, total / secs[f"{op}_base"] / MB
            print(f"{rep:>3}  {op:<4} {mo:>10.1f} {mb:>10.1f} {mo / mb:>6.2f}  {order[0]}",
                  flush=True)
        for k, s in secs.items():
            best[k] = min(best[k], s)

    clear("put")
    clear("get")
    mbps = {k: total / s / MB for k, s in best.items()}
    summary = {
        "put_ratio": round(mbps["put_ours"] / mbps["put_base"], 3),
        "get_ratio": round(mbps["get_ours"] / mbps["get_base"], 3),
        "put_ours_MBps": round(mbps["put_ours"], 1),
        "put_s3fs_MBps": round(mbps["put_base"], 1),
        "get_ours_MBps": round(mbps["get_ours"], 1),
        "get_s3fs_MBps": round(mbps["get_base"], 1),
        "objects": args.objects,
        "size_mib": args.size_mib,
        "concurrency": conc,
        "inflight_ours": inflight_ours,
        "inflight_s3fs": inflight_base,
        "repeat": args.repeat,
        "target": TARGET_RATIO,
    }
    summary["meets_target"] = (summary["put_ratio"] >= TARGET_RATIO
                               and summary["get_ratio"] >= TARGET_RATIO)
    print(f"\nbest of {args.repeat} (MB = 10^6 bytes):")
    for op, what in (("put", "Store.put_many vs s3fs pipe"), ("get", "Store.get_many vs s3fs cat")):
        ratio = summary[f"{op}_ratio"]
        verdict = "ok" if ratio >= TARGET_RATIO else f"BELOW {TARGET_RATIO}x"
        print(f"  batch {op}: ours {mbps[f'{op}_ours']:8.1f} MB/s   s3fs "
              f"{mbps[f'{op}_base']:8.1f} MB/s   ratio {ratio:.3f}  [{verdict}]  ({what})")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = None
    endpoint = args.endpoint
    if endpoint is None:
        server = MotoServer()
        server.start()
        endpoint = server.endpoint
        args.key, args.secret = MotoServer.ACCESS_KEY, MotoServer.SECRET_KEY
    try:
        summary = run(args, endpoint)
    finally:
        if server is not None:
            server.stop()
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
