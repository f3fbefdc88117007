"""Run in a fresh process after a crash: report what a reader sees, as JSON."""

from __future__ import annotations

import json
import os
import sys

from cloudckpt import latest_checkpoint, list_checkpoints, open_checkpoint


def main() -> None:
    root = sys.argv[1]
    options = json.loads(os.environ.get("CKPT_OPTIONS", "{}"))
    report = {"committed": [], "uncommitted": [], "latest": None}
    for info in list_checkpoints(root, options, include_uncommitted=True):
        if not info.committed:
            report["uncommitted"].append(info.name)
            continue
        ckpt = open_checkpoint(info.uri, options)
        ckpt.verify(deep=True)  # raises on any missing, short or corrupt object
        report["committed"].append({"name": info.name, "step": ckpt.step,
                                    "files": len(ckpt.files)})
    latest = latest_checkpoint(root, options)
    report["latest"] = latest.step if latest else None
    print(json.dumps(report))


if __name__ == "__main__":
    main()
