"""The GCS backend leaves its host alone: no environment variable set at import, gcsfs's
own default class untouched for the host's other users, and cloudckpt's client the core
class whatever that default is (gcsfs's experimental one stalls on an emulator)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import json, os, sys
import gcsfs
from cloudckpt import open_store

store = open_store(sys.argv[1], json.loads(sys.argv[2]))
store.put("probe", b"bytes")
print(json.dumps({"read": store.get("probe").decode(),
                  "variable": os.environ.get("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"),
                  "default": gcsfs.GCSFileSystem.__name__}))
"""


def test_gcs_backend_sets_nothing_and_uses_gcsfs_core_class(gcs):
    env = {k: v for k, v in {**os.environ, **gcs.env}.items()
           if k != "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"}
    # Several requests: each would stall about a minute through gcsfs's experimental class.
    r = subprocess.run([sys.executable, "-c", PROBE, gcs.uri("env"), gcs.options_json()],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.splitlines()[-1])
    assert seen == {"read": "bytes", "variable": None, "default": "ExtendedGcsFileSystem"}
