"""DCP save and load against every peer, with the client's CPU seconds per GB moved.

One run, on S3 (moto) and GCS (fake-gcs-server) on 127.0.0.1, two shapes of fp32
state (``few``: 16 x 16 MiB; ``many``: 512 x 0.5 MiB; 256 MiB each by default):

- ``cloudckpt``: ``cloudckpt.dcp.save`` / ``load``;
- ``torch-fsspec``: torch's ``FsspecWriter(thread_count=4, sync_files=False)`` /
  ``FsspecReader`` over s3fs or gcsfs;
- ``s3torchconnector``: AWS's ``S3StorageWriter(thread_count=4)`` / ``S3StorageReader``
  (its CRT client; S3 only: it has no GCS path);
- ``msc``: NVIDIA multi-storage-client's ``MultiStorageFileSystemWriter(thread_count=4)``
  / ``Reader`` with its Rust client on S3 (on GCS its Python client: the Rust one does
  not take the emulator's plain-HTTP endpoint);
- ``obstore``: the same bytes as one object per tensor, put and got concurrently with
  obstore (Rust), a native plain transfer (no DCP layer; S3 only here: fake-gcs-server
  does not serve the XML-API uploads object_store makes);
- ``plain``: the same bytes as one object per tensor with s3fs ``pipe`` / ``cat`` or
  gcsfs's, the transfer limit the ratios are taken against (as in ``dcp_bench.py``).

Every cell runs in a fresh child process: one untimed round (checked: a load must
give back the saved tensors), then ``--repeat`` timed ones, best kept. CPU is the
child's user + system time over the timed call (``getrusage``: native threads
included), per GB of state. A peer that cannot serve a cell is printed as such.

    python benchmarks/peers_bench.py [--size-mib 256] [--repeat 3] [--only s3|gcs]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

SIDES = ("cloudckpt", "torch-fsspec", "s3torchconnector", "msc", "obstore", "plain")
SHAPES = {"few": 16, "many": 512}
BUCKET = "peers"
KEY, SECRET, REGION = "testing", "testing", "us-east-1"
THREADS = 4


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ------------------------------------------------------------------ the sides


class Cell:
    """One side on one store: ``save(state, prefix)`` and ``load(state, prefix)``."""

    def __init__(self, side: str, store: str, endpoint: str, msc_config: str) -> None:
        self.side, self.store, self.endpoint = side, store, endpoint
        self.scheme = "s3" if store == "s3" else "gs"
        self.options: dict[str, Any] = (
            {"endpoint_url": endpoint, "key": KEY, "secret": SECRET} if store == "s3"
            else {"endpoint_url": endpoint, "token": "anon"})
        self.msc_config = msc_config

    def uri(self, prefix: str) -> str:
        if self.side == "msc":
            return f"msc://{self.store}/{prefix}"
        return f"{self.scheme}://{BUCKET}/{prefix}"

    def save(self, state: dict[str, Any], prefix: str) -> None:
        import torch.distributed.checkpoint as tdcp

        uri = self.uri(prefix)
        if self.side == "cloudckpt":
            import cloudckpt.dcp as cdcp

            cdcp.save(state, uri, storage_options=self.options)
        elif self.side == "torch-fsspec":
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            tdcp.save(state, storage_writer=FsspecWriter(
                uri, thread_count=THREADS, sync_files=False, **self.options))
        elif self.side == "s3torchconnector":
            from s3torchconnector import S3ClientConfig
            from s3torchconnector.dcp import S3StorageWriter

            tdcp.save(state, storage_writer=S3StorageWriter(
                REGION, uri, s3client_config=S3ClientConfig(force_path_style=True),
                thread_count=THREADS))
        elif self.side == "msc":
            from multistorageclient.contrib.torch import MultiStorageFileSystemWriter

            tdcp.save(state, storage_writer=MultiStorageFileSystemWriter(
                uri, thread_count=THREADS, sync_files=False))
        else:
            self._put({f"{prefix}/{k}": _raw(v) for k, v in state.items()})

    def load(self, state: dict[str, Any], prefix: str) -> None:
        import torch.distributed.checkpoint as tdcp

        uri = self.uri(prefix)
        if self.side == "cloudckpt":
            import cloudckpt.dcp as cdcp

            cdcp.load(state, uri, storage_options=self.options)
        elif self.side == "torch-fsspec":
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            tdcp.load(state, storage_reader=FsspecReader(uri, **self.options))
        elif self.side == "s3torchconnector":
            from s3torchconnector import S3ClientConfig
            from s3torchconnector.dcp import S3StorageReader

            tdcp.load(state, storage_reader=S3StorageReader(
                REGION, uri, s3client_config=S3ClientConfig(force_path_style=True)))
        elif self.side == "msc":
            from multistorageclient.contrib.torch import MultiStorageFileSystemReader

            tdcp.load(state, storage_reader=MultiStorageFileSystemReader(
                uri, thread_count=THREADS))
        else:
            got = self._get([f"{prefix}/{k}" for k in state])
            for t, data in zip(state.values(), got, strict=True):
                _raw_into(t, data)

    # plain transfers: s3fs/gcsfs, or obstore
    def _fs(self) -> Any:
        import fsspec

        return fsspec.filesystem(self.scheme, **self.options)

    def _obstore(self) -> Any:
        from obstore.store import S3Store

        return S3Store(BUCKET, endpoint=self.endpoint, access_key_id=KEY,
                       secret_access_key=SECRET, region=REGION,
                       client_options={"allow_http": True})

    def _put(self, objects: dict[str, bytes]) -> None:
        if self.side == "plain":
            self._fs().pipe({f"{BUCKET}/{k}": v for k, v in objects.items()}, batch_size=16)
            return
        import obstore

        store = self._obstore()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda kv: obstore.put(store, kv[0], kv[1]), objects.items()))

    def _get(self, keys: list[str]) -> list[bytes]:
        if self.side == "plain":
            fs = self._fs()
            got = fs.cat([f"{BUCKET}/{k}" for k in keys], batch_size=16)
            return [got[f"{BUCKET}/{k}"] for k in keys]
        import obstore

        store = self._obstore()
        with ThreadPoolExecutor(16) as pool:
            return list(pool.map(lambda k: obstore.get(store, k).bytes(), keys))


def _raw(t: Any) -> bytes:
    return t.numpy().tobytes()


def _raw_into(t: Any, data: Any) -> None:
    import torch

    t.copy_(torch.frombuffer(bytearray(bytes(data)), dtype=t.dtype).reshape(t.shape))


def cannot(side: str, store: str) -> str | None:
    """Why ``side`` cannot serve a cell on ``store``, or None."""
    if side == "s3torchconnector" and store == "gcs":
        return "cannot serve: no GCS path"
    if side == "obstore" and store == "gcs":
        # object_store writes through GCS's XML API, percent-encoding each key's
        # punctuation; fake-gcs-server answers those PUTs 404
        return "cannot serve: fake-gcs-server refuses its XML-API uploads"
    return None


# --------------------------------------------------------------- child and parent


def child(args: argparse.Namespace) -> int:
    import torch

    warnings.simplefilter("ignore")
    n = SHAPES[args.shape]
    per = args.size_mib * 2**20 // 4 // n
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n)}
    cell = Cell(args.side, args.store, args.endpoint, args.msc_config)
    base = f"{args.side}-{uuid.uuid4().hex[:8]}"
    cell.save(state, f"{base}/check")  # untimed: also the object every load reads
    target = {k: torch.empty_like(v) for k, v in state.items()}
    cell.load(target, f"{base}/check")
    bad = [k for k in state if not torch.equal(state[k], target[k])]
    if bad:
        raise SystemExit(f"{args.side} loaded {bad[:3]} wrong")
    best = (float("inf"), 0.0)
    for rep in range(args.repeat):
        target = {k: torch.empty_like(v) for k, v in state.items()}
        c0, t0 = cpu_s(), time.perf_counter()
        if args.op == "save":
            cell.save(state, f"{base}/r{rep}")
        else:
            cell.load(target, f"{base}/check")
        took, cpu = time.perf_counter() - t0, cpu_s() - c0
        best = min(best, (took, cpu))
    print(json.dumps({"seconds": best[0], "cpu_s": best[1],
                      "bytes": sum(t.numel() * 4 for t in state.values())}))
    return 0


def msc_config(s3_endpoint: str, gcs_endpoint: str, where: str) -> str:
    # Its Rust client on S3 (plain HTTP allowed for the loopback server); on GCS its
    # Rust client does not take the emulator's plain-HTTP endpoint: its Python client
    doc = {"profiles": {
        "s3": {"storage_provider": {"type": "s3", "options": {
            "base_path": BUCKET, "endpoint_url": s3_endpoint, "region_name": REGION,
            "rust_client": {"allow_http": True}}},
            "credentials_provider": {"type": "S3Credentials", "options": {
                "access_key": KEY, "secret_key": SECRET}}},
        "gcs": {"storage_provider": {"type": "gcs", "options": {
            "base_path": BUCKET, "endpoint_url": gcs_endpoint, "project_id": "bench",
            "skip_signature": True}}}}}
    path = os.path.join(where, "msc.json")
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


def run_cell(args: argparse.Namespace, side: str, op: str, store: str, shape: str,
             endpoint: str, env: dict[str, str], config: str) -> dict[str, Any] | str:
    cmd = [sys.executable, __file__, "--child", side, op, store, shape, endpoint, config,
           "--size-mib", str(args.size_mib), "--repeat", str(args.repeat)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["failed"])[-1]
        return f"failed: {last[:120]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--only", choices=("s3", "gcs"), default=None)
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--child", nargs=6, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.side, args.op, args.store, args.shape, args.endpoint, args.msc_config = args.child
        return child(args)
    from cloudckpt_testkit import FakeGcsServer, MotoServer

    sides = args.sides.split(",")
    stores = [args.only] if args.only else ["s3", "gcs"]
    summary: dict[str, Any] = {}
    with MotoServer() as moto, FakeGcsServer() as gcs, tempfile.TemporaryDirectory() as tmp:
        moto.create_bucket(BUCKET)
        gcs.create_bucket(BUCKET)
        config = msc_config(moto.endpoint, gcs.endpoint, tmp)
        for store in stores:
            endpoint = moto.endpoint if store == "s3" else gcs.endpoint
            env = {**os.environ, "MSC_CONFIG": config, "AWS_ENDPOINT_URL": moto.endpoint,
                   "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                   "AWS_DEFAULT_REGION": REGION, **gcs.env()}
            for shape in SHAPES:
                for op in ("save", "load"):
                    print(f"\n{store} {op}, {shape} ({SHAPES[shape]} tensors, "
                          f"{args.size_mib} MiB), best of {args.repeat}")
                    print(f"  {'side':<18} {'MB/s':>8} {'x plain':>8} {'CPU-s/GB':>9}")
                    rows = {}
                    for side in sides:
                        why = cannot(side, store)
                        rows[side] = why or run_cell(args, side, op, store, shape, endpoint,
                                                     env, config)
                    limit = rows.get("plain")
                    for side, r in rows.items():
                        if isinstance(r, str):
                            print(f"  {side:<18} {r}")
                            continue
                        mbps = r["bytes"] / r["seconds"] / 1e6
                        ratio = (f"{limit['seconds'] / r['seconds']:.2f}x"
                                 if isinstance(limit, dict) else "-")
                        print(f"  {side:<18} {mbps:>8.0f} {ratio:>8} "
                              f"{r['cpu_s'] / (r['bytes'] / 1e9):>9.2f}")
                    summary[f"{store}/{shape}/{op}"] = rows
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
