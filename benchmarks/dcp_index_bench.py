"""What a stock ``.metadata`` costs the coordinator of an indexed save, per chunk.

The indexed save writes ``.metadata`` itself only for small jobs
(``cloudckpt.dcp.ranksave.SMALL_JOB_CHUNKS``); this measures what building it from the
index and every rank's records, and pickling it, costs: a Llama-shaped state of
``--tensors`` tensors (weights and Adam's two moments, FSDP2's Shard(0)), every rank's
records decoded from bytes as the coordinator would receive them, at each of
``--worlds``. Prints microseconds per chunk and the chunks one second buys, and the
index's size beside the ``.metadata``'s, which grows with ranks.
"""

from __future__ import annotations

import argparse
import pickle
import time

from torch.distributed.checkpoint.metadata import TensorProperties

from cloudckpt.dcp.records import (
    Index,
    Location,
    RankRecords,
    Record,
    TensorEntry,
    stock_metadata,
    structure_digest,
)
from cloudckpt.dcp.rules import Rule


def _state(tensors: int, world: int) -> tuple[Index, dict[int, bytes]]:
    entries = [TensorEntry(f"model.layers.{i // 3}.p{i % 3}", (8192, 8192), TensorProperties(),
                           Rule.chunked(0, world)) for i in range(tensors)]
    entries.sort(key=lambda t: t.fqn)
    digest = structure_digest(world, 0, [(t.fqn, t.size, t.properties, t.rule)
                                         for t in entries], [])
    index = Index(world, 0, digest, entries)
    records = {}
    for r in range(world):
        recs = [Record(i, Location(f"__{r}_{i // 40}.distcp", (i % 40) << 20, 1 << 20,
                                   "0badf00d")) for i in range(tensors)]
        records[r] = RankRecords(r, digest, recs).encode()
    return index, records


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tensors", type=int, default=2100)
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 512])
    args = p.parse_args()
    print(f"{'ranks':>6} {'chunks':>10} {'build+pickle CPU s':>19} {'us/chunk':>9} "
          f"{'index KiB':>10} {'.metadata KiB':>14}")
    for world in args.worlds:
        index, raw = _state(args.tensors, world)
        start = time.process_time()
        records = {r: RankRecords.decode(b, source=str(r), rank=r, index=index)
                   for r, b in raw.items()}
        data = pickle.dumps(stock_metadata(index, records))
        took = time.process_time() - start
        chunks = args.tensors * world
        print(f"{world:>6} {chunks:>10} {took:>19.2f} {took / chunks * 1e6:>9.2f} "
              f"{len(index.encode()) / 1024:>10.0f} {len(data) / 1024:>14.0f}")


if __name__ == "__main__":
    main()
