"""Smoke test of an installed cloudckpt, run by .ci/install_check (not by pytest).

Run it with the python of the environment under test, from outside the source
tree (``python -I tests/install_smoke.py``): it must find the installed package,
every module of it must import with the plain install's dependencies, and a
checkpoint must round-trip on the local filesystem.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys
import tempfile

# Every third-party package cloudckpt imports outside its extras.
REQUIRED = ["torch", "safetensors", "fsspec", "s3fs", "gcsfs", "aiobotocore", "botocore",
            "boto3", "tenacity", "huggingface_hub", "tqdm", "google_crc32c", "numpy"]


#: Modules that need an extra the plain install lacks, and the extra.
EXTRAS = {"cloudckpt.storage.backends.azure.backend": "cloudckpt[azure]",
          "cloudckpt.compat.azure_private": "cloudckpt[azure]"}


def main() -> None:
    for name in REQUIRED:
        importlib.import_module(name)

    import cloudckpt

    where = os.path.realpath(cloudckpt.__file__)
    if not where.startswith(os.path.realpath(sys.prefix) + os.sep):
        sys.exit(f"cloudckpt imported from {where}, not from the environment {sys.prefix}")
    modules = [m.name for m in pkgutil.walk_packages(cloudckpt.__path__, "cloudckpt.")
               if not m.name.endswith(".__main__")]  # that one runs the CLI
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            # A module of an extra not installed here must say which one to install.
            if name in EXTRAS and EXTRAS[name] in str(exc):
                continue
            raise

    data = os.urandom(1 << 16)
    with tempfile.TemporaryDirectory(prefix="cloudckpt-smoke-") as root:
        run = os.path.join(root, "run")
        with cloudckpt.CheckpointWriter(os.path.join(run, "step-3"), step=3) as ckpt:
            ckpt.put("model.bin", data)
        listed = cloudckpt.list_checkpoints(run)
        if [(c.name, c.step, c.committed) for c in listed] != [("step-3", 3, True)]:
            sys.exit(f"list_checkpoints({run!r}) gave {listed!r}")
        back = cloudckpt.open_checkpoint(listed[0].uri).read("model.bin")
        if back != data:
            sys.exit(f"read back {len(back)} bytes that differ from the {len(data)} written")
    print(f"smoke test passed: cloudckpt {cloudckpt.__version__} from {os.path.dirname(where)}, "
          f"{len(modules)} modules imported, torch {sys.modules['torch'].__version__}, "
          f"boto3 {sys.modules['boto3'].__version__}")


if __name__ == "__main__":
    main()
