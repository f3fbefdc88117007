"""Shared fixtures: real S3 (moto, LocalStack), GCS (fake-gcs-server) and Azure (Azurite)
servers on 127.0.0.1.

Each server runs once per test session as a subprocess; state is reset
between tests. Nothing here skips: a missing server fails the test loudly.

The S3-facing tests take the server from one parameter, ``s3_server`` (through the ``s3``
and ``backend`` fixtures too): ``--s3-servers=moto,localstack`` runs each on both, and the
server's name is in the test's id. The default is moto alone; a run without moto keeps
only the tests that reach an S3 server (``make test-localstack``).
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
from cloudckpt_testkit import (  # noqa: E402
    AzuriteServer,
    FakeGcsServer,
    LocalStackServer,
    MotoServer,
)
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


S3_SERVERS = ("moto", "localstack")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--s3-servers", default="moto",
                     help="comma-separated S3 servers the S3-facing tests run against "
                          f"(of {', '.join(S3_SERVERS)}; default: moto)")


def _s3_servers(config: pytest.Config) -> list[str]:
    names = [n.strip() for n in config.getoption("--s3-servers").split(",") if n.strip()]
    unknown = sorted(set(names) - set(S3_SERVERS))
    if unknown or not names:
        raise pytest.UsageError(f"--s3-servers: unknown {unknown}; use some of {S3_SERVERS}")
    return names


#: ``backend``'s parameters: an S3 one per server (moto's keeps the plain id "s3").
_BACKENDS = ("file", "memory", "s3", "gcs", "azure")


def _backend_id(name: str, server: str | None = None) -> str:
    return name if server in (None, "moto") else f"{name}-{server}"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    servers = _s3_servers(metafunc.config)
    if "s3_server" in metafunc.fixturenames:
        metafunc.parametrize("s3_server", servers, indirect=True, scope="session")
    if "backend" in metafunc.fixturenames:
        params = [(b, srv) for b in _BACKENDS for srv in (servers if b == "s3" else [None])]
        metafunc.parametrize("backend", params, indirect=True,
                             ids=[_backend_id(b, srv) for b, srv in params])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without moto, keep only the tests that reach an S3 server (the LocalStack leg)."""
    if "moto" in _s3_servers(config):
        return
    kept, dropped = [], []
    for item in items:
        (kept if _reaches_s3(item) else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _reaches_s3(item: pytest.Item) -> bool:
    """Whether a test talks to the S3 server: through ``s3_server`` (``s3``, ``backend``),
    or a parameter naming S3 that it turns into a backend at run time."""
    if {"s3_server", "localstack_server"} & set(getattr(item, "fixturenames", ())):
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    for value in params.values():
        first = value[0] if isinstance(value, tuple) and value else value
        if isinstance(first, str) and (first == "s3" or first.startswith(("s3-", "s3_"))):
            return True
    return False


def pytest_report_header(config: pytest.Config) -> str:
    return f"S3 servers: {', '.join(_s3_servers(config))}"


@pytest.fixture(scope="session")
def moto_server():
    yield from _serving(MotoServer(part_min_size=256 * 1024))


@pytest.fixture(scope="session")
def localstack_server():
    yield from _serving(LocalStackServer())


@pytest.fixture(scope="session")
def s3_server(request) -> Any:
    """The S3 server of this test's parameter; for a test that asks for S3 only at run
    time (``request.getfixturevalue("s3")``), the first of ``--s3-servers``."""
    name = getattr(request, "param", None) or _s3_servers(request.config)[0]
    return request.getfixturevalue(f"{name}_server")


@pytest.fixture(scope="session")
def gcs_server():
    yield from _serving(FakeGcsServer())


@pytest.fixture(scope="session")
def azurite_server():
    yield from _serving(AzuriteServer())


@pytest.fixture
def s3(s3_server) -> Backend:
    return _fresh("s3", "s3", s3_server)


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


@pytest.fixture
def backend(request) -> Backend:
    """Every backend in turn, each over a real endpoint where one exists (S3 on each of
    ``--s3-servers``)."""
    name, server = request.param
    if name == "s3":
        return _fresh("s3", "s3", request.getfixturevalue(f"{server}_server"))
    return request.getfixturevalue({"file": "local"}.get(name, name))


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
