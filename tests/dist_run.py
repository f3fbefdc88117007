"""Run a module-level function on N real gloo ranks (spawned processes).

Each rank's return value (or its traceback) comes back to the test. A rank
that dies or hangs fails the test within ``timeout`` seconds.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import random
import socket
import traceback
from datetime import timedelta
from typing import Any


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port for a rendezvous, free now and outside the kernel's ephemeral range: a
    port the kernel handed out (bind to 0) is the kind it also gives the many client
    connections of the tests beside this one, and one of them took it before rank 0
    bound it ("address already in use") on a busy machine."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(10000, min(_ephemeral_low(), 32768))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range after 200 tries")


def _entry(rank: int, world: int, port: int, target: str, args: tuple, pg_timeout: float,
           queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    module, _, name = target.rpartition(".")
    fn = getattr(importlib.import_module(module), name)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout))
        try:
            queue.put((rank, "ok", fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(target: str, world: int, *args: Any, timeout: float = 180.0,
              pg_timeout: float = 60.0, allow_errors: bool = False) -> dict[int, Any]:
    """Run ``target`` ("module.function", called as ``fn(rank, world, *args)``) on
    ``world`` gloo ranks. Returns {rank: result}; with ``allow_errors``, failed
    ranks map to ``("error", traceback)`` and missing ones to ``("died", exitcode)``."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, target, args, pg_timeout, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    import queue as queue_mod
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, status, value = queue.get(timeout=0.5)
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs):
                    # Drain what is left, then stop waiting.
                    try:
                        while True:
                            rank, status, value = queue.get(timeout=0.5)
                            results[rank] = value if status == "ok" else ("error", value)
                    except queue_mod.Empty:
                        break
                continue
            results[rank] = value if status == "ok" else ("error", value)
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    for r, p in enumerate(procs):
        if r not in results:
            results[r] = ("died", p.exitcode)
    if not allow_errors:
        bad = {r: v for r, v in results.items() if isinstance(v, tuple) and v and
               v[0] in ("error", "died")}
        assert not bad, "\n".join(f"rank {r}: {v[1]}" for r, v in bad.items())
    return results
