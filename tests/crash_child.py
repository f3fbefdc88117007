"""A checkpoint writer that the crash tests SIGKILL at chosen points.

Usage: crash_child.py URI STEP STALL, with storage options as JSON in
CKPT_OPTIONS. It writes 20 objects, announcing each on stdout ("obj 0" ...),
then "commit", then commits. When it prints the line STALL it stops there, so
the parent's SIGKILL lands exactly at that point; STALL=in-manifest (local
stores) stops inside the manifest write, after its bytes are on disk but
before they are linked into place. STALL=none never stops.
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


STALL = "none"


def say(msg: str) -> None:
    print(msg, flush=True)
    if msg == STALL:
        time.sleep(120)


def main() -> None:
    global STALL
    uri, step, STALL = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    options = json.loads(os.environ.get("CKPT_OPTIONS", "{}"))
    if STALL == "in-manifest":
        real_link = os.link

        def stalled_link(src, dst, *a, **kw):
            if dst.endswith("cloudckpt-manifest.json"):
                say("in-manifest")
            return real_link(src, dst, *a, **kw)

        os.link = stalled_link
    writer = CheckpointWriter(uri, step=step, storage_options=options)
    for i in range(N_OBJECTS):
        writer.put(f"obj-{i:02d}.bin", payload(step, i))
        say(f"obj {i}")
    say("commit")
    writer.commit()
    say("done")


if __name__ == "__main__":
    main()
