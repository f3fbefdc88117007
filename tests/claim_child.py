"""A writer in a process of its own, launched as another node (tests/test_lease.py).

Claims ``uri`` by writing ``model.bin``, prints ``claimed``, then holds the claim
(renewing its lease) until the file ``go`` appears; then writes every name again, as
a zombie would, and tries to commit, printing ``committed`` or ``conflict: ...``.
"""

from __future__ import annotations

import json
import os
import sys
import time

from cloudckpt import CheckpointWriter, CommitConflictError

uri, options, go = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
writer = CheckpointWriter(uri, storage_options=options, step=1)
writer.put("model.bin", b"A" * 4096)
print("claimed", flush=True)
while not os.path.exists(go):
    time.sleep(0.05)
try:
    writer.put_many({"model.bin": b"Z" * 4096, "extra.bin": b"zombie"})
    writer.commit()
    print("committed", flush=True)
except CommitConflictError as exc:
    print(f"conflict: {exc}", flush=True)
