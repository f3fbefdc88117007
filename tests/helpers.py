"""Test helpers imported by name (not from ``conftest``: the suites under tests/torture
and tests/compat have their own conftest, and only one module can be ``conftest``)."""

from __future__ import annotations

import ast
import signal
import subprocess
from typing import Any

import pytest

HUB_TOKEN = "hf_cloudckpt_test_token_0123456789"


def finish(proc: subprocess.Popen, timeout: float = 300.0, what: str = "child"
           ) -> tuple[str, str]:
    """``proc.communicate()`` within a generous ``timeout``; a child still running then
    is failed with its threads' stacks (``PYTHONFAULTHANDLER``, set by the conftest,
    dumps them on SIGABRT), so a slow or stuck child says where it was."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        pytest.fail(f"{what} still running after {timeout:.0f} s; its stacks:\n"
                    f"{(err or '')[-12000:]}\nits output:\n{(out or '')[-2000:]}")


def torn_save(uri: str, options: dict[str, Any], objects: dict[str, bytes]) -> None:
    """What a save that failed before its commit leaves behind: its objects and its
    writer's claim, marked abandoned. (Objects put there by other means are not
    cloudckpt's, and no cloudckpt command treats them as a torn save.)"""
    from cloudckpt import CheckpointWriter

    w = CheckpointWriter(uri, storage_options=options)
    w.put_many(objects)
    w.abandon()


def shard_linears(model: Any, world: int) -> Any:
    """FSDP2 over a CPU mesh of ``world`` gloo ranks: each Linear layer of ``model``
    (a Sequential), then the whole model. Returns ``model``."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def boto3_s3(endpoint: str, **retries: Any) -> Any:
    """A plain boto3 S3 client for a test server (moto's test credentials);
    ``retries`` are botocore's (e.g. ``max_attempts=0``: one request per call)."""
    import boto3
    import botocore.config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=botocore.config.Config(retries=retries or None),
    )


def docstring_ids(tree: ast.AST) -> set[int]:
    """ids of the string constants of ``tree`` that are docstrings (which may explain,
    and name anything): the structure scans read every other string."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids
