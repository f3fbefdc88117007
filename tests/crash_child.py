"""A checkpoint writer that the crash tests SIGKILL at chosen points.

Usage: crash_child.py URI STEP PAUSE, with storage options as JSON in
CKPT_OPTIONS. It writes 20 objects, announcing each on stdout, then commits.
PAUSE=commit stops before the manifest write; PAUSE=manifest (local stores)
stops inside it, after the manifest's bytes are on disk but before they are
linked into place. The parent kills the process at the announced point.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

from cloudckpt import CheckpointWriter

N_OBJECTS = 20


def payload(step: int, i: int) -> bytes:
    rng = random.Random(step * 1000 + i)
    return rng.randbytes(20_000 + rng.randrange(20_000))


def say(msg: str) -> None:
    print(msg, flush=True)


def main() -> None:
    uri, step, pause = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    options = json.loads(os.environ.get("CKPT_OPTIONS", "{}"))
    if pause == "manifest":
        real_link = os.link

        def stalled_link(src, dst, *a, **kw):
            if dst.endswith("cloudckpt-manifest.json"):
                say("in-manifest")
                time.sleep(120)
            return real_link(src, dst, *a, **kw)

        os.link = stalled_link
    writer = CheckpointWriter(uri, step=step, storage_options=options)
    for i in range(N_OBJECTS):
        writer.put(f"obj-{i:02d}.bin", payload(step, i))
        say(f"obj {i}")
    say("commit")
    if pause == "commit":
        time.sleep(120)
    writer.commit()
    say("done")


if __name__ == "__main__":
    main()
