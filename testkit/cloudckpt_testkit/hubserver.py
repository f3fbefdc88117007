"""A small Hugging Face Hub-compatible HTTP server for tests.

:class:`HubServer` runs a :class:`~http.server.ThreadingHTTPServer` on
``127.0.0.1`` (free port) in a background thread and keeps every repo in
memory. It speaks the subset of the Hub API that ``huggingface_hub`` uses for
``create_repo``, ``repo_info``/``model_info``/``repo_exists``,
``create_commit``/``upload_file``/``upload_folder`` (preupload, Git LFS batch
API with basic and multipart transfers, NDJSON commit with additions and file or
folder deletions, ``parent_commit`` refused with 412 once the branch moved,
``create_pr``),
``hf_hub_download``/``snapshot_download`` (``resolve`` with HEAD, GET and
ranges, paginated ``tree`` listing), ``get_paths_info``, ``list_repo_refs``,
``list_repo_commits``, ``delete_repo`` and ``whoami``.

Limits the Hub enforces can be set to test a client against them: a per-file size
(``max_file_size``: the LFS batch answers a bigger object with a per-object error)
and a number of operations per commit (``max_commit_operations``: a bigger commit is
refused with HTTP 422, changing nothing). :meth:`HubServer.hold_lfs_uploads` holds
LFS uploads unanswered after a number of them, so a test can kill a client mid-push
at a known point.

Client setup: ``huggingface_hub`` reads ``HF_HUB_DISABLE_XET``,
``HF_HUB_OFFLINE``, ``HF_ENDPOINT`` and the cache paths when it is *imported*;
set them before that import or patch ``huggingface_hub.constants``. Xet must be
disabled (this server only speaks Git LFS), and pass ``endpoint=`` explicitly.

Auth: with ``token`` set, every request needs ``Authorization: Bearer <token>``
(else 401), except the LFS object upload URLs returned by the batch API: like
the Hub's presigned storage URLs they carry an unguessable secret and the
client sends them no ``Authorization`` header.

Like the Hub, a new repo starts with an ``initial commit`` holding a
``.gitattributes`` file, and a repo created without a namespace goes under
:attr:`HubServer.username`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import re
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

if TYPE_CHECKING:
    pass

from cloudckpt_testkit._lifecycle import StartStop

logger = logging.getLogger(__name__)

__all__ = ["HubServer"]

_HOST = "127.0.0.1"
_API_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}
_URL_PREFIXES = {"model": "", "dataset": "datasets/", "space": "spaces/"}
_LFS_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".npy",
    ".npz", ".pkl", ".pickle", ".gguf", ".ot", ".tflite", ".parquet", ".arrow", ".zip",
    ".tar", ".gz", ".zst",
)
_GITATTRIBUTES = "".join(f"*{s} filter=lfs diff=lfs merge=lfs -text\n" for s in _LFS_SUFFIXES)
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_HEX_RE = re.compile(r"[0-9a-f]{7,40}")
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_RANGE_RE = re.compile(r"bytes=(\d*)-(\d*)")
_UPLOAD_PREFIX = "lfs-upload"
_TRUE = ("1", "true", "True")

_RepoKey = tuple[str, str]  # (repo_type, repo_id)


def _now() -> str:
    """Current UTC time in the Hub's date format."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _git_blob_oid(data: bytes) -> str:
    """Git blob id (sha1 over ``blob <len>\\0`` + data)."""
    return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


@dataclass(frozen=True, eq=False)
class _Blob:
    """One file's content and its git / LFS identities."""

    data: bytes
    lfs: bool
    sha256: str
    git_oid: str
    pointer_size: int | None

    @classmethod
    def make(cls, data: bytes, lfs: bool) -> _Blob:
        sha = hashlib.sha256(data).hexdigest()
        if not lfs:
            return cls(data, False, sha, _git_blob_oid(data), None)
        pointer = (
            f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(data)}\n"
        ).encode()
        return cls(data, True, sha, _git_blob_oid(pointer), len(pointer))

    @property
    def etag(self) -> str:
        """What the Hub reports as the file's id: sha256 for LFS, git blob id otherwise."""
        return self.sha256 if self.lfs else self.git_oid

    def same_as(self, other: _Blob | None) -> bool:
        return other is not None and other.lfs == self.lfs and other.etag == self.etag


@dataclass
class _Commit:
    oid: str
    parents: tuple[str, ...]
    ref: str
    title: str
    message: str
    date: str
    files: dict[str, _Blob]
    added: tuple[str, ...]
    deleted: tuple[str, ...]
    pr_num: int | None = None


@dataclass
class _Repo:
    repo_type: str
    repo_id: str
    private: bool
    created: str
    refs: dict[str, str] = field(default_factory=dict)
    commits: dict[str, _Commit] = field(default_factory=dict)
    lfs: dict[str, bytes] = field(default_factory=dict)
    next_pr: int = 1

    @property
    def key(self) -> _RepoKey:
        return (self.repo_type, self.repo_id)


@dataclass
class _PendingUpload:
    repo: _RepoKey
    oid: str
    size: int
    chunk_size: int | None
    parts: dict[int, bytes] = field(default_factory=dict)

    @property
    def num_parts(self) -> int:
        if self.chunk_size is None:
            return 1
        return max(1, -(-self.size // self.chunk_size))


@dataclass
class _Response:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/json"


class _DropConnection(Exception):
    """Close the connection without an answer (an upload cut off mid-way)."""


class _HubError(Exception):
    """An HTTP error answer, with the Hub's ``X-Error-Code``/``X-Error-Message`` headers."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}

    def response(self) -> _Response:
        ascii_message = self.message.encode("ascii", "replace").decode()
        headers = {"X-Error-Message": ascii_message, **self.headers}
        if self.code is not None:
            headers["X-Error-Code"] = self.code
        return _Response(self.status, json.dumps({"error": self.message}).encode(), headers)


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> _Response:
    return _Response(status, json.dumps(payload).encode(), headers or {})


def _load_json(body: bytes) -> Any:
    try:
        return json.loads(body or b"{}")
    except ValueError as exc:
        raise _HubError(400, f"Invalid JSON body: {exc}") from exc


def _check_path(path: Any) -> str:
    """Validate a path inside a repo."""
    if not isinstance(path, str) or not path or path.startswith("/") or path.endswith("/"):
        raise _HubError(400, f"Invalid path in repo: {path!r}")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise _HubError(400, f"Invalid path in repo: {path!r}")
    return path


def _take_revision(segments: list[str]) -> tuple[str, list[str]]:
    """Split ``[rev, *rest]``; accepts an unencoded ``refs/pr/N`` as well as ``refs%2Fpr%2FN``."""
    if not segments:
        raise _HubError(400, "Missing revision")
    if segments[0] == "refs" and len(segments) >= 3:
        return "/".join(segments[:3]), segments[3:]
    return segments[0], segments[1:]


class _Handler(BaseHTTPRequestHandler):
    """Reads a request fully, hands it to the owning :class:`HubServer`, writes the answer."""

    protocol_version = "HTTP/1.1"
    timeout = 60
    server: _Server

    def do_GET(self) -> None:
        self._serve()

    def do_HEAD(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def do_PUT(self) -> None:
        self._serve()

    def do_DELETE(self) -> None:
        self._serve()

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("hubserver: " + format, *args)

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _serve(self) -> None:
        hub = self.server.hub
        try:
            body = self._read_body()
        except (ValueError, OSError):
            self.close_connection = True
            return
        try:
            response = hub._handle(self.command, self.path, self.headers, body)
        except _DropConnection:
            self.close_connection = True
            return
        except _HubError as exc:
            response = exc.response()
        except Exception as exc:  # a bug here must surface as a 500, not a hung client
            logger.exception("hubserver: %s %s failed", self.command, self.path)
            response = _HubError(500, f"Internal error: {type(exc).__name__}: {exc}").response()
        self.send_response(response.status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        for name, value in response.headers.items():
            if name.lower() != "content-length":
                self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response.body)


class _Server(ThreadingHTTPServer):
    """Threading server that can cut its open keep-alive connections on stop."""

    daemon_threads = True
    hub: HubServer

    def __init__(self, address: tuple[str, int]) -> None:
        super().__init__(address, _Handler)
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def drop_connections(self) -> None:
        """Shut down every open client connection (their handler threads then exit)."""
        with self._conns_lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class HubServer(StartStop):
    """In-memory Hugging Face Hub look-alike on ``127.0.0.1``, served from a background thread.

    Args:
        token: Bearer token every request must carry; ``None`` accepts any request.
        lfs_threshold: files larger than this (bytes) are uploaded through LFS; so are files
            with a binary suffix (``.safetensors``, ``.bin``, ...) or a NUL byte in their
            first 512 bytes.
        multipart_chunk_size: if set, LFS objects larger than this are uploaded with the
            multipart transfer in parts of this size; otherwise with one PUT.
        tree_page_size: entries per page of ``/tree`` listings (the Hub uses 1000).
        max_file_size: if set, the LFS batch answers an object larger than this (bytes)
            with a per-object error (``File too large``) instead of upload actions.
        max_commit_operations: if set, a commit with more operations (additions and
            deletions) is refused with HTTP 422 (``Too many operations``).
    """

    #: Namespace of repos created without one, and ``whoami`` name.
    username = "test-user"

    def __init__(
        self,
        token: str | None = "hf_test_token",
        *,
        lfs_threshold: int = 10 * 1024 * 1024,
        multipart_chunk_size: int | None = None,
        tree_page_size: int = 1000,
        max_file_size: int | None = None,
        max_commit_operations: int | None = None,
    ) -> None:
        if multipart_chunk_size is not None and multipart_chunk_size <= 0:
            raise ValueError("multipart_chunk_size must be positive")
        if tree_page_size <= 0:
            raise ValueError("tree_page_size must be positive")
        self.token = token
        self.lfs_threshold = lfs_threshold
        self.multipart_chunk_size = multipart_chunk_size
        self.tree_page_size = tree_page_size
        self.max_file_size = max_file_size
        self.max_commit_operations = max_commit_operations
        #: ``(method, path)`` of every request received, query string left out.
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.RLock()
        self._repos: dict[_RepoKey, _Repo] = {}
        self._uploads: dict[str, _PendingUpload] = {}
        self._counter = 0
        self._hold_after: int | None = None  # uploads let through before holding
        self._held = 0
        self._release = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------
    @property
    def port(self) -> int:
        """Port the server listens on; only valid after :meth:`start`."""
        if self._server is None:
            raise RuntimeError("HubServer is not started")
        return int(self._server.server_address[1])

    @property
    def endpoint(self) -> str:
        """Base URL, ``http://127.0.0.1:PORT``."""
        return f"http://{_HOST}:{self.port}"

    def start(self) -> None:
        """Bind a free port and serve in a daemon thread (no-op if already started)."""
        if self._server is not None:
            return
        server = _Server((_HOST, 0))
        server.hub = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05},
            name=f"HubServer:{self.port}", daemon=True,
        )
        self._thread.start()
        logger.debug("HubServer listening at %s", self.endpoint)

    def stop(self) -> None:
        """Stop serving and close the listening socket and open connections; repos are kept."""
        server, self._server = self._server, None
        thread, self._thread = self._thread, None
        if server is None:
            return
        self.release_lfs_uploads()
        server.shutdown()
        server.server_close()
        server.drop_connections()
        if thread is not None:
            thread.join(timeout=5)

    # -- assertions helpers ------------------------------------------------
    def files(
        self, repo_id: str, revision: str = "main", *, repo_type: str = "model"
    ) -> dict[str, bytes]:
        """Files held at ``revision`` (branch, ``refs/pr/N`` or commit sha), path -> bytes."""
        with self._lock:
            repo = self._get_repo(repo_type, repo_id)
            commit = self._resolve(repo, revision)
            return {path: blob.data for path, blob in sorted(commit.files.items())}

    def commits(self, repo_id: str, *, repo_type: str = "model") -> list[dict[str, Any]]:
        """Every commit of the repo (all branches and PRs), oldest first.

        Each dict has ``oid``, ``parents``, ``ref`` (``"main"``, ``"refs/pr/1"``...),
        ``title``, ``message``, ``date``, ``pr_num``, ``added`` (new or changed paths),
        ``deleted`` and ``lfs`` (the added paths stored through LFS).
        """
        with self._lock:
            repo = self._get_repo(repo_type, repo_id)
            return [
                {
                    "oid": c.oid,
                    "parents": list(c.parents),
                    "ref": c.ref,
                    "title": c.title,
                    "message": c.message,
                    "date": c.date,
                    "pr_num": c.pr_num,
                    "added": list(c.added),
                    "deleted": list(c.deleted),
                    "lfs": [p for p in c.added if c.files[p].lfs],
                }
                for c in repo.commits.values()
            ]

    def lfs_objects(self, repo_id: str, *, repo_type: str = "model") -> dict[str, int]:
        """The LFS objects stored for the repo, committed or not: sha256 -> size."""
        with self._lock:
            return {oid: len(data) for oid, data in
                    self._get_repo(repo_type, repo_id).lfs.items()}

    def lfs_uploads(self) -> int:
        """How many LFS object uploads were received (basic PUTs and multipart
        completions), stored or not."""
        with self._lock:
            return sum(1 for m, p in self.requests if p.startswith(f"/{_UPLOAD_PREFIX}/") and (
                (m == "PUT" and p.count("/") == 2) or m == "POST"))

    def hold_lfs_uploads(self, after: int = 0) -> None:
        """Let ``after`` more LFS object uploads through, then hold each further one
        unanswered (nothing stored) until :meth:`release_lfs_uploads`."""
        with self._lock:
            self._hold_after = after
            self._release = threading.Event()

    @property
    def held_lfs_uploads(self) -> int:
        """How many LFS uploads are being held now."""
        with self._lock:
            return self._held

    def release_lfs_uploads(self) -> None:
        """Stop holding: the held uploads are dropped (their connections closed, nothing
        stored, as when the client died mid-way); later uploads go through."""
        with self._lock:
            self._hold_after = None
            self._release.set()

    def _admit_upload(self) -> None:
        """Count one object upload against :meth:`hold_lfs_uploads`; a held one waits
        for the release, then drops its connection."""
        with self._lock:
            if self._hold_after is None:
                return
            if self._hold_after > 0:
                self._hold_after -= 1
                return
            self._held += 1
            release = self._release
        release.wait()
        with self._lock:
            self._held -= 1
        raise _DropConnection

    def refs(self, repo_id: str, *, repo_type: str = "model") -> dict[str, str]:
        """Branches and ``refs/pr/N`` refs of the repo, name -> commit sha."""
        with self._lock:
            return dict(self._get_repo(repo_type, repo_id).refs)

    # -- state -------------------------------------------------------------
    def _get_repo(self, repo_type: str, repo_id: str) -> _Repo:
        repo = self._repos.get((repo_type, repo_id))
        if repo is None:
            raise KeyError(f"no {repo_type} repo {repo_id!r} on this HubServer")
        return repo

    def _resolve(self, repo: _Repo, revision: str) -> _Commit:
        oid = repo.refs.get(revision)
        if oid is None and revision.startswith("refs/heads/"):
            oid = repo.refs.get(revision[len("refs/heads/"):])
        if oid is None and _HEX_RE.fullmatch(revision):
            matches = [o for o in repo.commits if o.startswith(revision)]
            if len(matches) == 1:
                oid = matches[0]
        if oid is None:
            raise _HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
        return repo.commits[oid]

    def _add_commit(
        self,
        repo: _Repo,
        ref: str,
        parent: _Commit | None,
        files: dict[str, _Blob],
        title: str,
        message: str,
        pr_num: int | None = None,
    ) -> _Commit:
        self._counter += 1
        old = parent.files if parent is not None else {}
        added = tuple(sorted(p for p, b in files.items() if not b.same_as(old.get(p))))
        deleted = tuple(sorted(set(old) - set(files)))
        seed = json.dumps(
            [repo.key, ref, parent.oid if parent else None, title, message, self._counter,
             time.time_ns(), sorted((p, b.git_oid) for p, b in files.items())]
        )
        commit = _Commit(
            oid=hashlib.sha1(seed.encode()).hexdigest(),
            parents=(parent.oid,) if parent is not None else (),
            ref=ref, title=title, message=message, date=_now(), files=files,
            added=added, deleted=deleted, pr_num=pr_num,
        )
        repo.commits[commit.oid] = commit
        repo.refs[ref] = commit.oid
        return commit

    def _repo_url(self, repo: _Repo) -> str:
        return f"{self.endpoint}/{_URL_PREFIXES[repo.repo_type]}{repo.repo_id}"

    def _find_repo(self, repo_type: str, segments: list[str], marker: str | None) -> int:
        """How many leading segments form the repo id (1 or 2); ``marker`` must follow them."""
        candidates = [
            n for n in (2, 1)
            if len(segments) >= n and (marker is None or segments[n:n + 1] == [marker])
        ]
        for n in candidates:
            if (repo_type, "/".join(segments[:n])) in self._repos:
                return n
        repo_id = "/".join(segments[: candidates[0]]) if candidates else "/".join(segments)
        raise _HubError(404, f"Repository not found: {repo_id}", "RepoNotFound")

    def _is_lfs(self, path: str, size: int, sample: bytes) -> bool:
        return size > self.lfs_threshold or path.lower().endswith(_LFS_SUFFIXES) or (
            b"\x00" in sample
        )

    # -- dispatch ----------------------------------------------------------
    def _handle(self, method: str, target: str, headers: Any, body: bytes) -> _Response:
        parts = urlsplit(target)
        path = parts.path
        with self._lock:
            self.requests.append((method, path))
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        segments = [unquote(s) for s in path.strip("/").split("/")] if path.strip("/") else []

        if segments[:1] == [_UPLOAD_PREFIX]:
            return self._route_upload(method, segments[1:], body)
        self._check_auth(headers.get("Authorization"))

        if segments[:1] == ["api"]:
            return self._route_api(method, segments[1:], query, body)
        repo_type = "model"
        if segments[:1] in (["datasets"], ["spaces"]):
            repo_type = _API_TYPES[segments[0]]
            segments = segments[1:]
        git = next((i for i, s in enumerate(segments[:2]) if s.endswith(".git")), None)
        if git is not None and segments[git + 1:git + 4] == ["info", "lfs", "objects"]:
            repo_id = "/".join([*segments[:git], segments[git][:-4]])
            action = segments[git + 4:]
            with self._lock:
                repo = self._repos.get((repo_type, repo_id))
                if repo is None:
                    raise _HubError(404, f"Repository not found: {repo_id}", "RepoNotFound")
                if method == "POST" and action == ["batch"]:
                    return self._lfs_batch(repo, _load_json(body))
                if method == "POST" and action == ["verify"]:
                    return self._lfs_verify(repo, _load_json(body))
            raise _HubError(404, f"Unknown LFS endpoint: {path}")
        if method in ("GET", "HEAD") and "resolve" in segments[1:3]:
            with self._lock:
                n = self._find_repo(repo_type, segments, "resolve")
                repo = self._repos[(repo_type, "/".join(segments[:n]))]
                revision, rest = _take_revision(segments[n + 1:])
                return self._resolve_file(repo, revision, "/".join(rest), headers.get("Range"))
        raise _HubError(404, f"Not found: {method} {path}")

    def _check_auth(self, header: str | None) -> None:
        if self.token is None:
            return
        if not header:
            raise _HubError(401, "Authorization header is required")
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            value.strip().encode(), self.token.encode()
        ):
            raise _HubError(401, "Invalid credentials in Authorization header")

    def _route_api(
        self, method: str, segments: list[str], query: dict[str, str], body: bytes
    ) -> _Response:
        if segments == ["whoami-v2"] and method == "GET":
            return _json(self._whoami())
        if segments == ["validate-yaml"] and method == "POST":
            return _json({"errors": [], "warnings": []})
        if segments == ["repos", "create"] and method == "POST":
            return self._create_repo(_load_json(body))
        if segments == ["repos", "delete"] and method == "DELETE":
            return self._delete_repo(_load_json(body))
        if not segments or segments[0] not in _API_TYPES:
            raise _HubError(404, f"Not found: {method} /api/{'/'.join(segments)}")
        repo_type = _API_TYPES[segments[0]]
        with self._lock:
            n = self._find_repo(repo_type, segments[1:], None)
            repo = self._repos[(repo_type, "/".join(segments[1:1 + n]))]
            rest = segments[1 + n:]
            action, args = (rest[0], rest[1:]) if rest else ("", [])
            if method == "GET" and action == "":
                return self._info(repo, "main", query)
            if method == "GET" and action == "revision":
                return self._info(repo, _take_revision(args)[0], query)
            if method == "GET" and action == "refs" and not args:
                return self._list_refs(repo)
            if not args:
                raise _HubError(404, f"Not found: {method} /api/{'/'.join(segments)}")
            revision, args = _take_revision(args)
            if method == "GET" and action == "tree":
                return self._tree(repo, revision, "/".join(args), query)
            if method == "GET" and action == "commits" and not args:
                return self._list_commits(repo, revision)
            if method == "POST" and action == "paths-info" and not args:
                return self._paths_info(repo, revision, body)
            if method == "POST" and action == "preupload" and not args:
                return self._preupload(repo, revision, _load_json(body))
            if method == "POST" and action == "commit" and not args:
                return self._commit(repo, revision, query.get("create_pr") in _TRUE, body)
        raise _HubError(404, f"Not found: {method} /api/{'/'.join(segments)}")

    # -- repos -------------------------------------------------------------
    def _whoami(self) -> dict[str, Any]:
        return {
            "type": "user", "id": "0" * 24, "name": self.username, "fullname": "Test User",
            "email": None, "emailVerified": True, "isPro": False, "canPay": False, "orgs": [],
            "auth": {"type": "access_token",
                     "accessToken": {"displayName": "hubserver", "role": "write"}},
        }

    def _repo_key_from_payload(self, payload: dict[str, Any]) -> _RepoKey:
        name, org = payload.get("name"), payload.get("organization")
        repo_type = payload.get("type") or "model"
        if repo_type not in _URL_PREFIXES:
            raise _HubError(400, f"Invalid repo type: {repo_type}")
        for part in (name, org or self.username):
            if not isinstance(part, str) or not _NAME_RE.fullmatch(part) or ".." in part:
                raise _HubError(400, f"Invalid repo name: {org}/{name}")
        return repo_type, f"{org or self.username}/{name}"

    def _create_repo(self, payload: dict[str, Any]) -> _Response:
        repo_type, repo_id = self._repo_key_from_payload(payload)
        private = payload.get("private")
        if private is None:
            private = payload.get("visibility") == "private"
        with self._lock:
            existing = self._repos.get((repo_type, repo_id))
            if existing is not None:
                return _json(
                    {"error": f"You already created this {repo_type} repo",
                     "url": self._repo_url(existing)},
                    status=409,
                    headers={"X-Error-Message": f"You already created this {repo_type} repo"},
                )
            repo = _Repo(repo_type, repo_id, bool(private), _now())
            files = {".gitattributes": _Blob.make(_GITATTRIBUTES.encode(), lfs=False)}
            self._add_commit(repo, "main", None, files, "initial commit", "")
            self._repos[repo.key] = repo
            url = self._repo_url(repo)
        logger.debug("HubServer: created %s repo %s", repo_type, repo_id)
        return _json({"url": url, "name": repo_id, "id": hashlib.sha1(url.encode()).hexdigest()})

    def _delete_repo(self, payload: dict[str, Any]) -> _Response:
        key = self._repo_key_from_payload(payload)
        with self._lock:
            if self._repos.pop(key, None) is None:
                raise _HubError(404, f"Repository not found: {key[1]}", "RepoNotFound")
        return _json({})

    def _info(self, repo: _Repo, revision: str, query: dict[str, str]) -> _Response:
        commit = self._resolve(repo, revision)
        blobs = query.get("blobs") in _TRUE
        siblings: list[dict[str, Any]] = []
        for path, blob in sorted(commit.files.items()):
            sibling: dict[str, Any] = {"rfilename": path}
            if blobs:
                sibling.update(size=len(blob.data), blobId=blob.git_oid)
                if blob.lfs:
                    sibling["lfs"] = {"size": len(blob.data), "sha256": blob.sha256,
                                      "pointerSize": blob.pointer_size}
            siblings.append(sibling)
        info: dict[str, Any] = {
            "_id": hashlib.sha1(repo.repo_id.encode()).hexdigest()[:24],
            "id": repo.repo_id,
            "author": repo.repo_id.split("/")[0],
            "sha": commit.oid,
            "lastModified": commit.date,
            "createdAt": repo.created,
            "private": repo.private,
            "gated": False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
            "usedStorage": sum(len(b.data) for b in commit.files.values()),
        }
        if repo.repo_type == "model":
            info["modelId"] = repo.repo_id
        return _json(info)

    def _list_refs(self, repo: _Repo) -> _Response:
        def ref_info(name: str, oid: str) -> dict[str, str]:
            full = name if name.startswith("refs/") else f"refs/heads/{name}"
            return {"name": name, "ref": full, "targetCommit": oid}

        refs = sorted(repo.refs.items())
        return _json({
            "branches": [ref_info(n, o) for n, o in refs if not n.startswith("refs/")],
            "converts": [ref_info(n, o) for n, o in refs if n.startswith("refs/convert/")],
            "tags": [ref_info(n, o) for n, o in refs if n.startswith("refs/tags/")],
            "pullRequests": [ref_info(n, o) for n, o in refs if n.startswith("refs/pr/")],
        })

    def _list_commits(self, repo: _Repo, revision: str) -> _Response:
        commit: _Commit | None = self._resolve(repo, revision)
        items = []
        while commit is not None:
            items.append({"id": commit.oid, "title": commit.title, "message": commit.message,
                          "authors": [{"user": self.username}], "date": commit.date})
            commit = repo.commits[commit.parents[0]] if commit.parents else None
        return _json(items)

    # -- listings ------------------------------------------------------------
    @staticmethod
    def _file_entry(path: str, blob: _Blob) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "oid": blob.git_oid, "size": len(blob.data),
                                 "path": path}
        if blob.lfs:
            entry["lfs"] = {"oid": blob.sha256, "size": len(blob.data),
                            "pointerSize": blob.pointer_size}
        return entry

    @staticmethod
    def _dir_entry(path: str, files: dict[str, _Blob]) -> dict[str, Any]:
        inner = sorted((p, b.git_oid) for p, b in files.items() if p.startswith(path + "/"))
        return {"type": "directory", "oid": hashlib.sha1(json.dumps(inner).encode()).hexdigest(),
                "size": 0, "path": path}

    def _tree(self, repo: _Repo, revision: str, path: str, query: dict[str, str]) -> _Response:
        commit = self._resolve(repo, revision)
        files = commit.files
        prefix = f"{path}/" if path else ""
        under = sorted(p for p in files if p.startswith(prefix))
        if path and not under:
            raise _HubError(404, f"Path not found: {path}", "EntryNotFound",
                            {"X-Repo-Commit": commit.oid})
        dirs: set[str] = set()
        for p in under:
            parts = p[len(prefix):].split("/")[:-1]
            dirs.update(prefix + "/".join(parts[: i + 1]) for i in range(len(parts)))
        names = sorted([*under, *dirs])
        if query.get("recursive") not in _TRUE:
            names = [n for n in names if "/" not in n[len(prefix):]]
        start = int(query.get("cursor") or 0)
        page = names[start:start + self.tree_page_size]
        entries = [
            self._file_entry(n, files[n]) if n in files else self._dir_entry(n, files)
            for n in page
        ]
        headers = {}
        if start + self.tree_page_size < len(names):
            next_query = {k: v for k, v in query.items() if k != "cursor"}
            next_query["cursor"] = str(start + self.tree_page_size)
            tree_path = "/".join(["tree", quote(revision, safe=""), *map(quote, path.split("/"))])
            url = (f"{self.endpoint}/api/{repo.repo_type}s/{repo.repo_id}/"
                   f"{tree_path.rstrip('/')}?{urlencode(next_query)}")
            headers["Link"] = f'<{url}>; rel="next"'
        return _json(entries, headers=headers)

    def _paths_info(self, repo: _Repo, revision: str, body: bytes) -> _Response:
        commit = self._resolve(repo, revision)
        form = parse_qs(body.decode(), keep_blank_values=True)
        out = []
        for path in form.get("paths", []):
            path = path.strip("/")
            if path in commit.files:
                out.append(self._file_entry(path, commit.files[path]))
            elif any(p.startswith(path + "/") for p in commit.files):
                out.append(self._dir_entry(path, commit.files))
        return _json(out)

    # -- downloads -------------------------------------------------------------
    def _resolve_file(
        self, repo: _Repo, revision: str, path: str, range_header: str | None
    ) -> _Response:
        commit = self._resolve(repo, revision)
        blob = commit.files.get(path)
        if blob is None:
            raise _HubError(404, f"Entry not found: {path}", "EntryNotFound",
                            {"X-Repo-Commit": commit.oid})
        headers = {
            "X-Repo-Commit": commit.oid,
            "ETag": f'"{blob.etag}"',
            "Accept-Ranges": "bytes",
        }
        if blob.lfs:
            headers["X-Linked-Etag"] = f'"{blob.sha256}"'
            headers["X-Linked-Size"] = str(len(blob.data))
        data = blob.data
        match = _RANGE_RE.fullmatch(range_header.strip()) if range_header else None
        if match is None or match.group(1) == match.group(2) == "":
            return _Response(200, data, headers, "application/octet-stream")
        total = len(data)
        if match.group(1):
            start = int(match.group(1))
            end = min(int(match.group(2)), total - 1) if match.group(2) else total - 1
        else:
            start, end = max(0, total - int(match.group(2))), total - 1
        if start >= total or start > end:
            raise _HubError(416, "Requested range not satisfiable",
                            headers={"Content-Range": f"bytes */{total}", **headers})
        headers["Content-Range"] = f"bytes {start}-{end}/{total}"
        return _Response(206, data[start:end + 1], headers, "application/octet-stream")

    # -- uploads ---------------------------------------------------------------
    def _preupload(self, repo: _Repo, revision: str, payload: dict[str, Any]) -> _Response:
        head = self._resolve(repo, revision)
        files = payload.get("files")
        if not isinstance(files, list):
            raise _HubError(400, "Expected a 'files' list")
        out = []
        for item in files:
            path = _check_path(item.get("path") if isinstance(item, dict) else None)
            size = item.get("size")
            if not isinstance(size, int) or size < 0:
                raise _HubError(400, f"Invalid size for {path}")
            try:
                sample = base64.b64decode(item.get("sample") or "")
            except (binascii.Error, ValueError) as exc:
                raise _HubError(400, f"Invalid sample for {path}") from exc
            mode = "lfs" if self._is_lfs(path, size, sample) else "regular"
            entry: dict[str, Any] = {"path": path, "uploadMode": mode, "shouldIgnore": False}
            existing = head.files.get(path)
            if existing is not None and existing.lfs == (mode == "lfs"):
                entry["oid"] = existing.etag
            out.append(entry)
        return _json({"files": out, "commitOid": head.oid})

    def _lfs_batch(self, repo: _Repo, payload: dict[str, Any]) -> _Response:
        if payload.get("operation") != "upload":
            raise _HubError(422, f"Unsupported LFS operation: {payload.get('operation')!r}")
        objects = payload.get("objects")
        if not isinstance(objects, list):
            raise _HubError(422, "Expected an 'objects' list")
        transfers = payload.get("transfers") or ["basic"]
        chunk = self.multipart_chunk_size if "multipart" in transfers else None
        out: list[dict[str, Any]] = []
        used_multipart = False
        for obj in objects:
            oid, size = obj.get("oid"), obj.get("size")
            if not isinstance(oid, str) or not _SHA256_RE.fullmatch(oid) or not isinstance(
                size, int
            ) or size < 0:
                out.append({"oid": str(oid), "size": size if isinstance(size, int) else -1,
                            "error": {"code": 422, "message": "Invalid oid or size"}})
                continue
            if self.max_file_size is not None and size > self.max_file_size:
                out.append({"oid": oid, "size": size, "error": {
                    "code": 422, "message": f"File too large: {size} bytes, over the limit of "
                                            f"{self.max_file_size} bytes per file"}})
                continue
            stored = repo.lfs.get(oid)
            if stored is not None and len(stored) == size:
                out.append({"oid": oid, "size": size})  # already there: no actions
                continue
            token = secrets.token_urlsafe(24)
            multipart = chunk is not None and size > chunk
            upload = _PendingUpload(repo.key, oid, size, chunk if multipart else None)
            self._uploads[token] = upload
            href = f"{self.endpoint}/{_UPLOAD_PREFIX}/{token}"
            action: dict[str, Any] = {"href": href}
            if multipart:
                used_multipart = True
                action["header"] = {
                    "chunk_size": str(chunk),
                    **{str(i): f"{href}/{i}" for i in range(1, upload.num_parts + 1)},
                }
            verify = {"href": f"{self._repo_url(repo)}.git/info/lfs/objects/verify"}
            out.append({"oid": oid, "size": size, "authenticated": True,
                        "actions": {"upload": action, "verify": verify}})
        response = _json({"transfer": "multipart" if used_multipart else "basic",
                          "objects": out, "hash_algo": "sha256"})
        response.content_type = "application/vnd.git-lfs+json"
        return response

    def _lfs_verify(self, repo: _Repo, payload: dict[str, Any]) -> _Response:
        oid, size = payload.get("oid"), payload.get("size")
        stored = repo.lfs.get(oid) if isinstance(oid, str) else None
        if stored is None:
            raise _HubError(404, f"LFS object not found: {oid}")
        if size is not None and size != len(stored):
            raise _HubError(422, f"LFS object {oid} has size {len(stored)}, not {size}")
        return _json({"oid": oid, "size": len(stored)})

    def _route_upload(self, method: str, segments: list[str], body: bytes) -> _Response:
        with self._lock:
            upload = self._uploads.get(segments[0]) if segments else None
        if upload is None or len(segments) > 2:
            raise _HubError(404, "Unknown or expired upload URL")
        if method == "PUT" and len(segments) == 1 and upload.chunk_size is None:
            self._admit_upload()
            self._store_lfs(upload, body)
            return _Response(200, headers={"ETag": f'"{hashlib.md5(body).hexdigest()}"'})
        if method == "PUT" and len(segments) == 2 and upload.chunk_size is not None:
            if not segments[1].isdigit() or not 1 <= int(segments[1]) <= upload.num_parts:
                raise _HubError(400, f"Invalid part number: {segments[1]}")
            etag = hashlib.md5(body).hexdigest()
            with self._lock:
                upload.parts[int(segments[1])] = body
            return _Response(200, headers={"ETag": f'"{etag}"'})
        if method == "POST" and len(segments) == 1 and upload.chunk_size is not None:
            self._admit_upload()
            return self._complete_multipart(upload, _load_json(body))
        raise _HubError(405, f"{method} not allowed on this upload URL")

    def _complete_multipart(self, upload: _PendingUpload, payload: dict[str, Any]) -> _Response:
        if payload.get("oid") != upload.oid:
            raise _HubError(400, "Completion oid does not match the upload")
        parts = payload.get("parts")
        expected = list(range(1, upload.num_parts + 1))
        if not isinstance(parts, list) or [p.get("partNumber") for p in parts] != expected:
            raise _HubError(400, f"Completion must list parts {expected} in order")
        with self._lock:
            chunks = []
            for part in parts:
                data = upload.parts.get(part["partNumber"])
                if data is None:
                    raise _HubError(400, f"Part {part['partNumber']} was not uploaded")
                if str(part.get("etag", "")).strip('"') != hashlib.md5(data).hexdigest():
                    raise _HubError(400, f"ETag mismatch for part {part['partNumber']}")
                chunks.append(data)
        self._store_lfs(upload, b"".join(chunks))
        return _json({})

    def _store_lfs(self, upload: _PendingUpload, data: bytes) -> None:
        if len(data) != upload.size:
            raise _HubError(400, f"Size mismatch: expected {upload.size} bytes, got {len(data)}")
        if hashlib.sha256(data).hexdigest() != upload.oid:
            raise _HubError(400, f"sha256 mismatch: content does not hash to {upload.oid}")
        with self._lock:
            repo = self._repos.get(upload.repo)
            if repo is None:
                raise _HubError(404, f"Repository not found: {upload.repo[1]}", "RepoNotFound")
            repo.lfs[upload.oid] = data
        logger.debug("HubServer: stored LFS object %s (%d bytes)", upload.oid, len(data))

    def _commit(self, repo: _Repo, revision: str, create_pr: bool, body: bytes) -> _Response:
        try:
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        except ValueError as exc:
            raise _HubError(400, f"Invalid NDJSON commit payload: {exc}") from exc
        if not lines or lines[0].get("key") != "header":
            raise _HubError(400, "Commit payload must start with a 'header' line")
        header = lines[0].get("value") or {}
        n_ops = len(lines) - 1
        if self.max_commit_operations is not None and n_ops > self.max_commit_operations:
            raise _HubError(422, f"Too many operations in one commit: {n_ops}, at most "
                                 f"{self.max_commit_operations}; split it into several commits")
        title = header.get("summary")
        if not isinstance(title, str) or not title:
            raise _HubError(400, "Commit summary is required")
        if revision.startswith("refs/heads/"):
            revision = revision[len("refs/heads/"):]
        base = self._resolve(repo, revision)  # 404 RevisionNotFound if unknown
        if revision not in repo.refs and not create_pr:
            raise _HubError(400, f"Cannot commit to {revision}: not a branch")
        parent_oid = header.get("parentCommit")
        if parent_oid:
            parent = self._resolve(repo, str(parent_oid))
            if create_pr:
                base = parent
            elif parent.oid != base.oid:
                raise _HubError(412, "A commit has happened since. Please refresh and try again.")
        files = dict(base.files)
        for line in lines[1:]:
            self._apply(repo, files, line.get("key"), line.get("value") or {})
        pr_num = None
        ref = revision
        if create_pr:
            pr_num, repo.next_pr = repo.next_pr, repo.next_pr + 1
            ref = f"refs/pr/{pr_num}"
        commit = self._add_commit(
            repo, ref, base, files, title, str(header.get("description") or ""), pr_num
        )
        repo_url = self._repo_url(repo)
        result: dict[str, Any] = {"success": True, "commitOid": commit.oid,
                                  "commitUrl": f"{repo_url}/commit/{commit.oid}",
                                  "hookOutput": ""}
        if pr_num is not None:
            result["pullRequestUrl"] = f"{repo_url}/discussions/{pr_num}"
        logger.debug("HubServer: commit %s on %s/%s", commit.oid, repo.repo_id, ref)
        return _json(result)

    @staticmethod
    def _apply(repo: _Repo, files: dict[str, _Blob], key: Any, value: dict[str, Any]) -> None:
        """Apply one NDJSON commit operation to ``files``."""
        if key == "file":
            path = _check_path(value.get("path"))
            content = value.get("content") or ""
            if value.get("encoding", "utf-8") == "base64":
                try:
                    data = base64.b64decode(content, validate=True)
                except (binascii.Error, ValueError) as exc:
                    raise _HubError(400, f"Invalid base64 content for {path}") from exc
            else:
                data = str(content).encode()
            files[path] = _Blob.make(data, lfs=False)
        elif key == "lfsFile":
            path = _check_path(value.get("path"))
            oid = value.get("oid")
            data = repo.lfs.get(oid) if isinstance(oid, str) else None
            if data is None:
                raise _HubError(422, f"LFS object {oid} for {path} was not uploaded")
            if value.get("size") is not None and value["size"] != len(data):
                raise _HubError(422, f"Size mismatch for LFS file {path}")
            files[path] = _Blob.make(data, lfs=True)
        elif key == "deletedFile":
            path = _check_path(value.get("path"))
            if files.pop(path, None) is None:
                raise _HubError(404, f"A file with this name doesn't exist: {path}",
                                "EntryNotFound")
        elif key == "deletedFolder":
            prefix = _check_path(str(value.get("path", "")).rstrip("/")) + "/"
            doomed = [p for p in files if p.startswith(prefix)]
            if not doomed:
                raise _HubError(404, f"A folder with this name doesn't exist: {prefix}",
                                "EntryNotFound")
            for p in doomed:
                del files[p]
        else:
            raise _HubError(400, f"Unknown commit operation: {key!r}")
