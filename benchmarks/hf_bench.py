"""HF export to S3 against plain s3fs uploading the same bytes, in the same run
(moto S3 on 127.0.0.1), and the export's peak extra host memory.

    python benchmarks/hf_bench.py [--size-mib 256] [--tensors 16] [--repeat 3]

Targets: export >= 0.85x plain s3fs concurrent upload; extra memory about one
shard's transfer buffers, not the model.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import warnings

import s3fs
import torch
from cloudckpt_testkit import MotoServer

from cloudckpt import hf

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRss:
    """Samples RSS every few milliseconds while active."""

    def __enter__(self) -> PeakRss:
        self.base, self.peak, self._stop = rss(), rss(), threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.003):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--max-shard-size", default="5GB")
    args = p.parse_args()
    warnings.simplefilter("ignore")
    n = args.size_mib * 1024 * 1024 // 4 // args.tensors
    state = {f"model.layers.{i}.weight": torch.randn(n) for i in range(args.tensors)}
    size = sum(t.nbytes for t in state.values())
    raw = {k: v.numpy().tobytes() for k, v in state.items()}  # the baseline's bytes

    with MotoServer() as server:
        server.create_bucket("bench")
        opts = server.storage_options()
        fs = s3fs.S3FileSystem(**opts)
        ours, base, peaks = [], [], []
        for rep in range(args.repeat):
            for first in ("ours", "base") if rep % 2 == 0 else ("base", "ours"):
                if first == "ours":
                    with PeakRss() as mem:
                        t0 = time.perf_counter()
                        hf.export(state, f"s3://bench/export-{rep}", config={"model_type": "x"},
                                  max_shard_size=args.max_shard_size, storage_options=opts)
                        ours.append(time.perf_counter() - t0)
                    peaks.append(mem.peak - mem.base)
                else:
                    t0 = time.perf_counter()
                    fs.pipe({f"bench/plain-{rep}/{k}": v for k, v in raw.items()},
                            batch_size=16)
                    base.append(time.perf_counter() - t0)
        back = hf.load_state_dict("s3://bench/export-0", storage_options=opts)
        assert all(torch.equal(back[k], state[k]) for k in state), "export differs"

    mb = size / 1e6
    o, b = min(ours), min(base)
    ratio = b / o
    print(f"model: {mb:.0f} MB in {args.tensors} fp32 tensors, max_shard_size "
          f"{args.max_shard_size}, moto S3 on 127.0.0.1, best of {args.repeat}")
    print(f"  hf.export:               {o:6.3f} s  {mb / o:7.1f} MB/s")
    print(f"  plain s3fs pipe (16):    {b:6.3f} s  {mb / b:7.1f} MB/s")
    print(f"  ratio export / s3fs = {ratio:.3f}  target >= 0.85  "
          f"[{'ok' if ratio >= 0.85 else 'MISSED'}]")
    print(f"  peak extra RSS during export (worst rep): {max(peaks) / 1e6:.0f} MB "
          f"({max(peaks) / size:.2f}x the model's {mb:.0f} MB)")
    print(json.dumps({"size_mb": round(mb, 1), "export_s": round(o, 3), "s3fs_s": round(b, 3),
                      "ratio": round(ratio, 3), "peak_extra_rss_mb": round(max(peaks) / 1e6),
                      "meets_target": ratio >= 0.85}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
