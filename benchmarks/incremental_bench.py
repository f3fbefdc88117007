"""Incremental saves against full ones: a state whose bytes are 90% frozen (a base
model) and 10% trained (adapters and their Adam state), saved ten times with a
training step between saves. One run, moto S3 on 127.0.0.1.

    python benchmarks/incremental_bench.py [--size-mib 512] [--saves 10]

Baseline: the same ten saves with ``incremental=False`` (every byte sent every
time), measured in the same run, and SHA-256 alone over the state's bytes (the
digest an incremental save computes). Figures: each save's time and bytes sent;
the digest's share of a full save's time and its CPU seconds per GB; the bytes
stored after ten saves against one full save; restore time; a save's peak RSS
above the process's own before it.

Goals: saves 2..10 send <= 12% of a full save's bytes in <= 0.25x its time; the
digest costs <= 10% of a full save's time; ten saves store <= 2x one full save;
restores are bit-exact.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
from _rss import PeakRss  # benchmarks/_rss.py: run as a script, its folder is on the path
from cloudckpt_testkit import MotoServer

from cloudckpt import CheckpointManager, ManagerOptions, StepInfo
from cloudckpt.core.committed import open_checkpoint
from cloudckpt.core.manifest import MANIFEST_NAME
from cloudckpt.storage import open_store

MiB = 1024 * 1024


class Adapted(torch.nn.Module):
    """A frozen base (``base_mib``) and trainable adapters whose Adam state makes
    up the rest: parameters a third of ``adapter_mib``, Adam's moments two thirds."""

    def __init__(self, base_mib: int, adapter_mib: int, layers: int = 16) -> None:
        super().__init__()
        base_n = base_mib * MiB // 4 // layers
        adapter_n = adapter_mib * MiB // 3 // 4 // (2 * layers)
        self.base = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(base_n), requires_grad=False) for _ in range(layers))
        self.adapters = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(adapter_n) * 0.01) for _ in range(2 * layers))


def train_step(model: Adapted, opt: torch.optim.Optimizer) -> None:
    for p in model.adapters:
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad()


def sent_bytes(uri: str, opts: dict) -> int:
    """What a save sent: the DCP files it did not find in the blob area, and every other
    object (state, ``.metadata``, manifests); all of it for a full save."""
    ckpt = open_checkpoint(uri, opts)
    model = open_checkpoint(f"{uri}/model", opts)
    inc = model.metadata["dcp"].get("incremental")
    if inc is None:
        return ckpt.total_size + len(ckpt.store.get(MANIFEST_NAME))
    others = sum(e.size for p, e in ckpt.manifest.files.items()
                 if not (p.startswith("model/__") and p.endswith(".distcp")))
    return inc["sent_bytes"] + others + len(ckpt.store.get(MANIFEST_NAME))


def stored_bytes(uri: str, opts: dict) -> int:
    return sum(o.size for o in open_store(uri, opts).list())


def run(name: str, incremental: bool, args: argparse.Namespace, opts: dict) -> dict:
    torch.manual_seed(0)
    base = args.size_mib * 9 // 10
    model = Adapted(base, args.size_mib - base)
    opt = torch.optim.Adam(model.adapters.parameters())
    train_step(model, opt)  # Adam's state exists from the first save on
    root = f"s3://bench/{name}"
    mgr = CheckpointManager(root, ManagerOptions(every_steps=1, incremental=incremental),
                            storage_options=opts)
    times, sent, peaks = [], [], []
    for step in range(1, args.saves + 1):
        train_step(model, opt)
        info = StepInfo(global_step=step, epoch_step=step, steps_per_epoch=10**6)
        with PeakRss() as rss:
            t0 = time.perf_counter()
            mgr.save(info, {"model": model, "optim": opt}, rng=False)
            times.append(time.perf_counter() - t0)
        peaks.append(rss.peak - rss.baseline)  # above the state itself
        sent.append(sent_bytes(f"{root}/step-{step}", opts))
    mgr.close()
    fresh = Adapted(base, args.size_mib - base)
    fresh_opt = torch.optim.Adam(fresh.adapters.parameters())
    train_step(fresh, fresh_opt)
    t0 = time.perf_counter()
    CheckpointManager(root, storage_options=opts).restore({"model": fresh, "optim": fresh_opt},
                                                          rng=False)
    restore_s = time.perf_counter() - t0
    exact = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  fresh.state_dict().values(), strict=True))
    exact &= all(torch.equal(a, b) for a, b in zip(
        (t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)),
        (t for s in fresh_opt.state.values() for t in s.values() if torch.is_tensor(t)),
        strict=True))
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return {"name": name, "times": times, "sent": sent, "peak_rss": max(peaks),
            "stored": stored_bytes(root, opts), "restore_s": restore_s, "exact": exact,
            "state_bytes": state_bytes, "model": model}


def digest_cost(model: torch.nn.Module, threads: int) -> tuple[float, float]:
    """SHA-256 over every tensor's bytes, ``threads`` at once as a save hashes its
    files: wall seconds, and CPU seconds."""
    import hashlib

    views = [t.detach().numpy().view("uint8") for t in model.state_dict().values()]
    cpu0, t0 = time.process_time(), time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda v: hashlib.sha256(v).digest(), views))
    return time.perf_counter() - t0, time.process_time() - cpu0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--saves", type=int, default=10)
    args = p.parse_args()
    warnings.simplefilter("ignore")
    with MotoServer() as server:
        server.create_bucket("bench")
        opts = server.storage_options()
        full = run("full", False, args, opts)
        inc = run("incremental", True, args, opts)
    digest_s, digest_cpu = digest_cost(inc["model"], 16)
    gb = inc["state_bytes"] / 1e9
    full_save = sum(full["times"]) / len(full["times"])  # the mean full save
    full_sent = sum(full["sent"]) / len(full["sent"])
    later_t = inc["times"][1:]
    later_b = inc["sent"][1:]
    print(f"moto S3 on 127.0.0.1; a {args.size_mib} MiB state, 90% frozen; "
          f"{args.saves} saves each way")
    print(f"{'save':>5} {'full s':>8} {'full MiB':>9} {'incr s':>8} {'incr MiB':>9}")
    for k in range(args.saves):
        print(f"{k + 1:>5} {full['times'][k]:8.3f} {full['sent'][k] / MiB:9.1f} "
              f"{inc['times'][k]:8.3f} {inc['sent'][k] / MiB:9.1f}")
    ratios = {
        "later_bytes_over_full": max(later_b) / full_sent,
        "later_time_over_full": max(later_t) / full_save,
        "digest_over_full_save": digest_s / full_save,
        "stored_over_one_full": inc["stored"] / full_sent,
    }
    goals = {"later_bytes_over_full": 0.12, "later_time_over_full": 0.25,
             "digest_over_full_save": 0.10, "stored_over_one_full": 2.0}
    for key, value in ratios.items():
        print(f"{key} = {value:.3f} (goal <= {goals[key]}) "
              f"[{'ok' if value <= goals[key] else 'MISSED'}]")
    print(f"digest: {digest_s:.3f} s wall over {gb:.2f} GB, {digest_cpu / gb:.2f} CPU-s/GB; "
          f"restore: full {full['restore_s']:.3f} s, incremental {inc['restore_s']:.3f} s; "
          f"bit-exact: full {full['exact']}, incremental {inc['exact']}")
    print(f"peak RSS of a save above the process's before it: full "
          f"{full['peak_rss'] / MiB:.0f} MiB, incremental "
          f"{inc['peak_rss'] / MiB:.0f} MiB; stored after {args.saves} saves: full "
          f"{full['stored'] / MiB:.0f} MiB, incremental {inc['stored'] / MiB:.0f} MiB")
    print(json.dumps({**{k: round(v, 3) for k, v in ratios.items()},
                      "digest_cpu_s_per_gb": round(digest_cpu / gb, 3),
                      "exact": full["exact"] and inc["exact"]}))
    return 0 if full["exact"] and inc["exact"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
