"""Save and load of CUDA bf16 state through cloudckpt against the plain transfer of the
same bytes and against torch DCP, on one GPU, in one run.

For each size (``--sizes-gib``, default 1 and 8) a state of CUDA bf16 tensors of
``--tensor-mib`` each is made, then, each side timed once after an untimed warm-up
save of the first size (so that pools and pinned buffers are made outside the timing,
as in a training run's later saves):

- ``d2h_pinned``: the state copied into preallocated pinned host memory
  (``non_blocking``, then synchronize): the floor an async save's blocked time is
  held to;
- ``plain_put`` / ``plain_get``: those pinned bytes uploaded to moto (on 127.0.0.1)
  through cloudckpt's own store, one object per tensor, and read back into pinned
  memory then copied to the GPU: the transfer a sync save and a load are held to;
- ``ckpt_save_s3`` / ``ckpt_load_s3``: ``cloudckpt.dcp.save``/``load`` (CUDA tensors
  through the pinned pool; the load into CUDA tensors);
- ``ckpt_async_s3``: ``cloudckpt.dcp.async_save`` with one ``BudgetStager`` kept
  between saves: blocked time and time to durable;
- ``ckpt_save_disk`` / ``torch_fs_save_disk``: cloudckpt and torch's ``FileSystemWriter``
  to ``--local-dir`` (local NVMe on a GPU machine);
- ``torch_async_disk``: torch's ``dcp.async_save`` with ``DefaultStager`` (pinned,
  non-blocking copies) to ``--local-dir``: blocked time and time to durable;
- ``s3torchconnector_save_s3``: its DCP writer to moto, where the package imports.

Every side's peak host RSS above its start (the kernel's high-water mark) and the
pinned bytes held are shown. The last lines are the acceptance ratios and one JSON
summary. A side that fails or does not run is shown with its reason, never left out.
``--deadline-s`` stops starting sides once that much time has passed (the 8 GiB
sides are then reported as not run), so `make gpu-check` ends within its 8 minutes.

Needs: torch with CUDA, and what `make test` needs (moto, boto3, the test kit on
the path: `make gpu-check` sets it); s3torchconnector optional. No network beyond
127.0.0.1.

Usage::

    python benchmarks/gpu_bench.py [--sizes-gib 1 8] [--tensor-mib 256]
                                   [--local-dir DIR] [--deadline-s 330]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _rss import PeakRss  # noqa: E402  (benchmarks/_rss.py)

GiB = 1 << 30
MiB = 1 << 20


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-gib", type=float, nargs="+", default=[1.0, 8.0])
    p.add_argument("--tensor-mib", type=int, default=256)
    p.add_argument("--local-dir", default=None, help="default: a temporary directory")
    p.add_argument("--deadline-s", type=float, default=330.0)
    return p.parse_args()


def make_state(nbytes: int, tensor_mib: int) -> dict[str, torch.Tensor]:
    n = max(1, nbytes // (tensor_mib * MiB))
    g = torch.Generator(device="cuda").manual_seed(0)
    return {f"layer{i}.weight": torch.randn(tensor_mib * MiB // 2, device="cuda", generator=g,
                                           dtype=torch.float32).to(torch.bfloat16)
            for i in range(n)}


def pinned_held() -> int:
    from cloudckpt.dcp import devicecopy
    return devicecopy.shared_pinned_bytes()


class Run:
    """Times sides, records each one's figures or why it did not run."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.results: dict[str, dict[str, Any]] = {}

    def side(self, name: str, nbytes: int, fn: Callable[[], dict[str, float] | None]) -> None:
        if time.monotonic() > self.deadline:
            self.results[name] = {"not_run": "the run's deadline had passed"}
            print(f"{name:34s} not run: deadline", flush=True)
            return
        try:
            torch.cuda.synchronize()
            with PeakRss() as rss:
                t0 = time.perf_counter()
                extra = fn() or {}
                secs = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 - every side is reported
            self.results[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"{name:34s} FAILED: {type(exc).__name__}: {exc}"[:300], flush=True)
            return
        fig = {"seconds": round(secs, 4), "gb_per_s": round(nbytes / secs / 1e9, 3),
               "peak_rss_above_mib": round(rss.above / MiB, 1),
               "pinned_mib": round(pinned_held() / MiB, 1),
               **{k: round(v, 4) for k, v in extra.items()}}
        self.results[name] = fig
        print(f"{name:34s} {fig}", flush=True)


def main() -> int:
    args = parse()
    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA device; nothing measured", flush=True)
        return 2
    from cloudckpt_testkit import MotoServer

    import cloudckpt.dcp as cdcp
    from cloudckpt.dcp import BudgetStager
    from cloudckpt.storage import open_store

    start = time.monotonic()
    run = Run(start + args.deadline_s)
    local_root = args.local_dir or tempfile.mkdtemp(prefix="gpu-bench-")
    server = MotoServer()
    server.start()
    try:
        opts = server.storage_options()
        bucket = "gpu-bench"
        server.create_bucket(bucket)
        root = f"s3://{bucket}"
        stager = BudgetStager(int(max(args.sizes_gib) * GiB) + GiB)
        print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
        warm = make_state(min(GiB, int(args.sizes_gib[0] * GiB)), args.tensor_mib)
        cdcp.save(warm, f"{root}/warm", storage_options=opts)
        cdcp.async_save(warm, f"{root}/warm-async", storage_options=opts,
                        stager=stager).result()
        del warm
        for size in args.sizes_gib:
            tag = f"{size:g}GiB"
            state = make_state(int(size * GiB), args.tensor_mib)
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            sides(run, tag, state, nbytes, root, opts, local_root, stager, cdcp, open_store)
            del state
            torch.cuda.empty_cache()
    finally:
        server.stop()
        if args.local_dir is None:
            shutil.rmtree(local_root, ignore_errors=True)
    report(run.results, args.sizes_gib)
    return 0


def sides(run: Run, tag: str, state: dict[str, torch.Tensor], nbytes: int, root: str,
          opts: dict[str, Any], local_root: str, stager: Any, cdcp: Any, open_store: Any
          ) -> None:
    pinned = {k: torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, pin_memory=True)
              for k, t in state.items()}

    def d2h() -> None:
        for k, t in state.items():
            pinned[k].copy_(t.view(-1).view(torch.uint8), non_blocking=True)
        torch.cuda.synchronize()

    run.side(f"d2h_pinned[{tag}]", nbytes, d2h)
    store = open_store(f"{root}/plain-{tag}", opts)

    def plain_put() -> None:
        store.map(lambda k: store.put(k, memoryview(pinned[k].numpy())), list(pinned))

    def plain_get() -> None:
        def one(k: str) -> None:
            store.read_range_into(k, 0, [memoryview(pinned[k].numpy())])
            state[k].view(-1).view(torch.uint8).copy_(pinned[k], non_blocking=True)
        store.map(one, list(pinned))
        torch.cuda.synchronize()

    run.side(f"plain_put[{tag}]", nbytes, plain_put)
    run.side(f"plain_get[{tag}]", nbytes, plain_get)
    store.delete(list(pinned))
    pinned.clear()
    expected = {k: t.clone() for k, t in state.items()} if nbytes <= 2 * GiB else None

    run.side(f"ckpt_save_s3[{tag}]", nbytes,
             lambda: cdcp.save(state, f"{root}/save-{tag}", storage_options=opts) and None)
    dest = {k: torch.empty_like(t) for k, t in state.items()}

    def load() -> None:
        cdcp.load(dest, f"{root}/save-{tag}", storage_options=opts)
        torch.cuda.synchronize()

    run.side(f"ckpt_load_s3[{tag}]", nbytes, load)
    if expected is not None and f"ckpt_load_s3[{tag}]" in run.results and \
            "seconds" in run.results[f"ckpt_load_s3[{tag}]"]:
        run.results[f"ckpt_load_s3[{tag}]"]["bit_exact"] = all(
            torch.equal(dest[k], v) for k, v in expected.items())
    dest.clear()
    expected = None

    def async_save() -> dict[str, float]:
        t0 = time.perf_counter()
        fut = cdcp.async_save(state, f"{root}/async-{tag}", storage_options=opts, stager=stager)
        blocked = time.perf_counter() - t0
        fut.result()
        return {"blocked_s": blocked, "durable_s": time.perf_counter() - t0,
                "stager_allocations": float(stager.allocations)}

    run.side(f"ckpt_async_s3[{tag}]", nbytes, async_save)
    run.side(f"ckpt_save_disk[{tag}]", nbytes,
             lambda: cdcp.save(state, os.path.join(local_root, f"ckpt-{tag}")) and None)
    torch_sides(run, tag, state, nbytes, local_root)
    s3torchconnector_side(run, tag, state, nbytes, root, opts)
    open_store(root, opts).delete([o.key for o in open_store(root, opts).list(internal=True)
                                   if tag in o.key])
    shutil.rmtree(local_root, ignore_errors=True)
    os.makedirs(local_root, exist_ok=True)


def torch_sides(run: Run, tag: str, state: dict[str, torch.Tensor], nbytes: int,
                local_root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    run.side(f"torch_fs_save_disk[{tag}]", nbytes, lambda: dcp.save(
        state, storage_writer=FileSystemWriter(os.path.join(local_root, f"fs-{tag}")),
        no_dist=True) and None)

    def torch_async() -> dict[str, float]:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                              use_async_staging=True,
                                              use_non_blocking_copy=True))
        t0 = time.perf_counter()
        resp = dcp.async_save(state, storage_writer=FileSystemWriter(
            os.path.join(local_root, f"fs-async-{tag}")), async_stager=stager, no_dist=True)
        staging = getattr(resp, "staging_completion", None)
        if staging is not None:
            staging.result()  # the caller may change the state once staging is done
        blocked = time.perf_counter() - t0
        upload = getattr(resp, "upload_completion", resp)
        upload.result()
        stager.close()
        return {"blocked_s": blocked, "durable_s": time.perf_counter() - t0}

    run.side(f"torch_async_disk[{tag}]", nbytes, torch_async)


def s3torchconnector_side(run: Run, tag: str, state: dict[str, torch.Tensor], nbytes: int,
                          root: str, opts: dict[str, Any]) -> None:
    name = f"s3torchconnector_save_s3[{tag}]"
    try:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageWriter
    except ImportError as exc:
        run.results[name] = {"not_run": f"s3torchconnector does not import: {exc}"}
        print(f"{name:34s} not run: not importable", flush=True)
        return
    import torch.distributed.checkpoint as dcp
    os.environ.setdefault("AWS_ACCESS_KEY_ID", opts["key"])
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", opts["secret"])
    os.environ["AWS_ENDPOINT_URL"] = opts["endpoint_url"]

    def save() -> None:
        from cloudckpt_testkit import MotoServer
        writer = S3StorageWriter(region=MotoServer.REGION, path=f"{root}/s3tc-{tag}",
                                 s3client_config=S3ClientConfig(force_path_style=True))
        dcp.save(state, storage_writer=writer, no_dist=True)

    run.side(name, nbytes, save)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def report(results: dict[str, dict[str, Any]], sizes: list[float]) -> None:
    def get(side: str, key: str = "seconds") -> float | None:
        return results.get(side, {}).get(key)

    accept: dict[str, Any] = {}
    for size in sizes:
        tag = f"{size:g}GiB"
        blocked = get(f"ckpt_async_s3[{tag}]", "blocked_s")
        accept[tag] = {
            # at most 1.2
            "async_blocked_over_d2h": ratio(blocked, get(f"d2h_pinned[{tag}]")),
            # at most 1.0
            "async_blocked_over_torch_async": ratio(
                blocked, get(f"torch_async_disk[{tag}]", "blocked_s")),
            # at least 0.95 (throughput: plain time over ours)
            "save_vs_plain_put": ratio(get(f"plain_put[{tag}]"), get(f"ckpt_save_s3[{tag}]")),
            "load_vs_plain_get": ratio(get(f"plain_get[{tag}]"), get(f"ckpt_load_s3[{tag}]")),
        }
        a = accept[tag]
        a["met"] = {
            "async_blocked": (a["async_blocked_over_d2h"] or 9) <= 1.2 and
            (a["async_blocked_over_torch_async"] or 9) <= 1.0,
            "save": (a["save_vs_plain_put"] or 0) >= 0.95,
            "load": (a["load_vs_plain_get"] or 0) >= 0.95,
        }
        print(f"acceptance [{tag}]: {a}", flush=True)
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "results": results, "acceptance": accept}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
