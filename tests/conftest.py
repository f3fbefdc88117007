"""Shared fixtures: real S3 (moto) and GCS (fake-gcs-server) servers on 127.0.0.1.

Each server runs once per test session as a subprocess; state is reset
between tests. Nothing here skips: a missing server fails the test loudly.
"""

from __future__ import annotations

import os
import uuid

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
# Dummy credentials so no client ever looks for real ones.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.pop("AWS_ENDPOINT_URL", None)
# huggingface_hub reads these when imported: plain LFS uploads, online.
os.environ["HF_HUB_DISABLE_XET"] = "1"
os.environ["HF_HUB_OFFLINE"] = "0"
# Every child Python dumps its threads' stacks on SIGABRT: a child a test gives up on
# says where it was (tests/helpers.finish).
os.environ["PYTHONFAULTHANDLER"] = "1"

import json  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
from cloudckpt_testkit import AzuriteServer, FakeGcsServer, MotoServer  # noqa: E402
from helpers import HUB_TOKEN  # noqa: E402

from cloudckpt.storage import RetryPolicy  # noqa: E402

BUCKET = "cloudckpt-test"
#: Fast retries for tests: the deadline still bounds every operation.
FAST_RETRY = {"initial_backoff": 0.02, "max_backoff": 0.3, "max_attempts": 10, "deadline": 60.0}


@dataclass
class Backend:
    """A place to put checkpoints: a root URI and the options to reach it."""

    name: str
    root: str
    options: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    def uri(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def options_json(self) -> str:
        """The options as JSON, for a child process (``retry`` as a dict)."""
        return json.dumps({k: asdict(v) if isinstance(v, RetryPolicy) else v
                           for k, v in self.options.items()})


def _serving(server: Any) -> Any:
    server.start()
    yield server
    server.stop()


def _fresh(name: str, scheme: str, server: Any) -> Backend:
    """An empty bucket on ``server`` and a fresh prefix in it, with fast retries."""
    server.reset()
    server.create_bucket(BUCKET)
    opts = {**server.storage_options(), "retry": RetryPolicy(**FAST_RETRY)}
    return Backend(name, f"{scheme}://{BUCKET}/runs/{uuid.uuid4().hex[:8]}", opts,
                   server.env())


@pytest.fixture(scope="session")
def moto_server():
    yield from _serving(MotoServer(part_min_size=256 * 1024))


@pytest.fixture(scope="session")
def gcs_server():
    yield from _serving(FakeGcsServer())


@pytest.fixture(scope="session")
def azurite_server():
    yield from _serving(AzuriteServer())


@pytest.fixture
def s3(moto_server) -> Backend:
    return _fresh("s3", "s3", moto_server)


@pytest.fixture
def gcs(gcs_server) -> Backend:
    return _fresh("gcs", "gs", gcs_server)


@pytest.fixture
def azure(azurite_server) -> Backend:
    return _fresh("azure", "az", azurite_server)


@pytest.fixture
def local(tmp_path) -> Backend:
    return Backend("file", str(tmp_path / "store"), {"fsync": False})


@pytest.fixture
def memory() -> Backend:
    return Backend("memory", f"memory://cloudckpt-tests/{uuid.uuid4().hex}")


@pytest.fixture(params=["file", "memory", "s3", "gcs", "azure"])
def backend(request) -> Backend:
    """Every backend in turn, each over a real endpoint where one exists."""
    return request.getfixturevalue({"file": "local"}.get(request.param, request.param))


@pytest.fixture
def hub_server(tmp_path, monkeypatch):
    """A Hub-compatible server on 127.0.0.1, with huggingface_hub isolated from the
    real user cache and tokens (its constants are read at import, so patch both)."""
    from cloudckpt_testkit import HubServer
    from huggingface_hub import constants

    home = tmp_path / "hf_home"
    for name, value in {"HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"),
                        "HF_TOKEN_PATH": str(home / "token"), "HF_HUB_DISABLE_XET": "1"}.items():
        monkeypatch.setenv(name, value)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    with HubServer(token=HUB_TOKEN) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        yield server
