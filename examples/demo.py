"""cloudckpt demo: save a model checkpoint to S3, list it, verify it, load it back.

With no S3 endpoint configured (no AWS_ENDPOINT_URL and no --root), an
embedded S3 server (moto) is started on 127.0.0.1, so the demo runs anywhere.

    python examples/demo.py                      # embedded S3
    python examples/demo.py --root s3://my-bucket/demo-run   # your bucket
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from contextlib import ExitStack

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

import cloudckpt


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", help="where checkpoints go, e.g. s3://bucket/run (default: "
                        "an embedded S3 server)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    with ExitStack() as stack:
        options: dict = {}
        root = args.root
        if root is None and not os.environ.get("AWS_ENDPOINT_URL"):
            from cloudckpt.testing import MotoServer

            server = stack.enter_context(MotoServer())
            server.create_bucket("cloudckpt-demo")
            options = server.storage_options()
            root = "s3://cloudckpt-demo/runs/demo"
            print(f"started an embedded S3 server at {server.endpoint}")
        elif root is None:
            root = "s3://cloudckpt-demo/runs/demo"

        model = build_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = torch.randn(32, 64), torch.randn(32, 8)
        for step in range(1, 4):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            uri = f"{root}/step-{step}"
            t0 = time.perf_counter()
            with cloudckpt.CheckpointWriter(uri, step=step, metadata={"loss": loss.item()},
                                            storage_options=options) as ckpt:
                ckpt.put("model.safetensors", save_safetensors(model.state_dict()))
                ckpt.put("train_state.json", json.dumps({"step": step}).encode())
            print(f"saved  {uri}  loss={loss.item():.4f}  ({time.perf_counter() - t0:.2f}s)")

        print("\ncheckpoints under", root)
        for info in cloudckpt.list_checkpoints(root, options):
            print(f"  {info.name:<8} step={info.step}  {info.files} objects  {info.size} bytes")

        latest = cloudckpt.latest_checkpoint(root, options)
        assert latest is not None
        latest.verify(deep=True)
        print(f"\nlatest: {latest.uri} (verified: sizes and CRC32C of {len(latest.files)} objects)")

        restored = build_model()
        restored.load_state_dict(load_safetensors(latest.read("model.safetensors")))
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                      restored.state_dict().values(), strict=True))
        print(f"loaded back into a fresh model: parameters identical = {same}")
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
