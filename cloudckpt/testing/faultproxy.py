"""Fault-injecting HTTP reverse proxy for exercising retries over real HTTP.

Place a :class:`FaultProxy` between a client (s3fs, gcsfs, boto3) and a local
server (moto, fake-gcs-server) and point the client at ``proxy.endpoint``.
Mocks cannot reproduce what matters here: throttling responses parsed by the
real SDK, connections reset mid-request, bodies shorter than their
Content-Length, and a client killed while its request is in flight.

Requests are forwarded byte-for-byte in spirit: method, target, headers (the
``Host`` header exactly as the client sent it, so SigV4 signatures made for the
proxy's address still verify) and body. Chunked request bodies are re-sent
chunked; ``Expect: 100-continue`` is answered by the proxy itself. Absolute
``Location`` headers that point at the upstream are rewritten to the proxy, so
GCS resumable-upload sessions keep flowing through it.
"""

from __future__ import annotations

import http.client
import http.server
import json
import logging
import random
import socket
import socketserver
import struct
import threading
import traceback
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import Self

logger = logging.getLogger(__name__)

FAULT_KINDS = ("slowdown", "throttle", "internal", "reset", "truncate")

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "upgrade",
        "expect",
        "transfer-encoding",
    }
)
_GCS_PREFIXES = (
    "/storage/v1/",
    "/upload/storage/v1/",
    "/download/storage/v1/",
    "/batch/storage/v1",
)
# status -> (S3 error code, message); codes chosen so SDKs classify them as
# they would the real thing (botocore treats "Throttling" as a throttle).
_ERRORS: dict[int, tuple[str, str]] = {
    403: ("AccessDenied", "Access Denied"),
    404: ("NoSuchKey", "The specified key does not exist."),
    429: ("Throttling", "Rate exceeded"),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}
_KIND_STATUS = {"slowdown": 503, "throttle": 429, "internal": 500}
_COPY_CHUNK = 64 * 1024
_HOLD_TIMEOUT_S = 30.0


@dataclass
class FaultPlan:
    """What the proxy should break, and how often.

    ``match`` scopes everything (faults, ``permanent_status`` and
    ``latency_s``) to requests whose target (path plus query) contains it.
    ``max_faults`` bounds the faults injected under this plan, including
    ``permanent_status`` ones. ``truncate`` on a response with an empty body
    degenerates to "send headers, then close".
    """

    error_rate: float = 0.0
    kinds: tuple[str, ...] = ("slowdown",)
    permanent_status: int | None = None
    latency_s: float = 0.0
    seed: int | None = None
    match: str | None = None
    max_faults: int | None = None

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; use {FAULT_KINDS}")
        if not self.kinds and self.error_rate > 0:
            raise ValueError("error_rate > 0 needs at least one kind")
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError("error_rate must be within [0, 1]")


class _Server(http.server.ThreadingHTTPServer):
    """Threaded server that tracks client sockets so stop() can cut them."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, proxy: FaultProxy) -> None:
        self.proxy = proxy
        self._conns: set[socket.socket] = set()
        self._rst: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)

    def server_bind(self) -> None:
        # Skip HTTPServer.server_bind's getfqdn(): a reverse DNS lookup is
        # pointless here and can hang on hosts without a resolver.
        socketserver.TCPServer.server_bind(self)
        self.server_name = "127.0.0.1"
        self.server_port = self.server_address[1]

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def mark_rst(self, sock: socket.socket) -> None:
        """Close ``sock`` with an RST instead of a FIN once the handler ends."""
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with self._conns_lock:
            self._rst.add(sock)

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
            rst = request in self._rst
            self._rst.discard(request)
        if rst:
            # No shutdown(SHUT_WR): that would send a FIN before the RST.
            self.close_request(request)
        else:
            super().shutdown_request(request)

    def cut_all(self) -> None:
        """Wake handler threads blocked on idle keep-alive reads."""
        with self._conns_lock:
            conns = list(self._conns)
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Called from socketserver's except block; client hang-ups land here.
        logger.debug("fault proxy: error serving %s:\n%s", client_address, traceback.format_exc())


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 120  # idle keep-alive clients eventually release their thread
    server: _Server

    def setup(self) -> None:
        super().setup()
        self._upstream: http.client.HTTPConnection | None = None

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self._drop_upstream()

    def log_message(self, fmt: str, *args: Any) -> None:
        logger.debug("fault proxy: " + fmt, *args)

    # -- request handling --------------------------------------------------
    def _handle(self) -> None:
        proxy = self.server.proxy
        try:
            body, chunked = self._read_body()
        except (OSError, ValueError) as exc:
            logger.debug("fault proxy: bad request body: %s", exc)
            self.close_connection = True
            return
        action, latency = proxy._decide(self.path)
        proxy._notify(self.command, self.path)
        if proxy._should_hold(self.path):
            proxy.held.set()
            if not proxy.release.wait(_HOLD_TIMEOUT_S):
                logger.warning("fault proxy: hold on %s timed out", self.path)
            if proxy.hold_action == "drop":
                self.close_connection = True
                return
        if latency > 0 and proxy._stopping.wait(latency):
            self.close_connection = True
            return
        try:
            if action is None:
                self._forward(body, chunked, truncate=False)
            elif action == "reset":
                self.close_connection = True
                self.server.mark_rst(self.connection)
            elif action == "truncate":
                self._forward(body, chunked, truncate=True)
            else:
                self._send_error_response(int(action))
        except OSError as exc:
            # Client went away (e.g. killed mid-request): nothing to answer.
            logger.debug("fault proxy: client write failed: %s", exc)
            self.close_connection = True

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle
    do_PATCH = do_OPTIONS = _handle

    def _read_body(self) -> tuple[bytes | None, bool]:
        """Read the whole request body; returns (body, was_chunked)."""
        te = self.headers.get("Transfer-Encoding", "")
        if "chunked" in te.lower():
            parts: list[bytes] = []
            while True:
                line = self.rfile.readline(65537)
                if not line:
                    raise ValueError("EOF inside chunked body")
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                        pass  # discard trailers
                    return b"".join(parts), True
                parts.append(self._read_exact(size))
                self.rfile.readline(65537)  # CRLF after chunk data
        length = self.headers.get("Content-Length")
        if length is None:
            return None, False
        return self._read_exact(int(length)), False

    def _read_exact(self, n: int) -> bytes:
        data = self.rfile.read(n)
        if len(data) != n:
            raise ValueError(f"short body: got {len(data)} of {n} bytes")
        return data

    # -- upstream ----------------------------------------------------------
    def _drop_upstream(self) -> None:
        if self._upstream is not None:
            self._upstream.close()
            self._upstream = None

    def _send_upstream(self, body: bytes | None, chunked: bool) -> http.client.HTTPResponse:
        """Send the request upstream, retrying once if a pooled conn was stale."""
        proxy = self.server.proxy
        target = proxy._upstream_prefix + self.path
        for attempt in (0, 1):
            fresh = self._upstream is None
            if fresh:
                self._upstream = http.client.HTTPConnection(
                    proxy._upstream_host, proxy._upstream_port, timeout=120
                )
            conn = self._upstream
            assert conn is not None
            try:
                conn.putrequest(self.command, target, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in _HOP_BY_HOP:
                        conn.putheader(name, value)
                if chunked:
                    conn.putheader("Transfer-Encoding", "chunked")
                conn.endheaders(body if body else None, encode_chunked=chunked)
                if chunked and not body:
                    conn.send(b"0\r\n\r\n")
                return conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionError) as exc:
                self._drop_upstream()
                if fresh or attempt:
                    raise
                logger.debug("fault proxy: stale upstream conn (%s); retrying", exc)
        raise AssertionError("unreachable")

    def _forward(self, body: bytes | None, chunked: bool, truncate: bool) -> None:
        try:
            resp = self._send_upstream(body, chunked)
        except (OSError, http.client.HTTPException) as exc:
            logger.warning("fault proxy: upstream failed: %s", exc)
            self._drop_upstream()
            self._send_simple(502, b"upstream unavailable", "text/plain")
            return

        headers = [
            (k, self._rewrite_location(v) if k.lower() == "location" else v)
            for k, v in resp.getheaders()
            if k.lower() not in _HOP_BY_HOP
        ]
        bodyless = self.command == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
        if bodyless:
            resp.read()
            self._start_response(resp.status, resp.reason, headers)
            self._finish_upstream(resp)
            return

        length = resp.length if not resp.chunked else None
        if length is None or truncate:
            data = resp.read()
            headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
            headers.append(("Content-Length", str(len(data))))
            self._start_response(resp.status, resp.reason, headers)
            self._finish_upstream(resp)
            if truncate:
                self.wfile.write(data[: len(data) // 2])
                self.close_connection = True
            else:
                self.wfile.write(data)
            return

        self._start_response(resp.status, resp.reason, headers)
        remaining = length
        while remaining > 0:
            chunk = resp.read(min(_COPY_CHUNK, remaining))
            if not chunk:
                # Upstream died mid-body; the client must see it too.
                self._drop_upstream()
                self.close_connection = True
                return
            remaining -= len(chunk)
            try:
                self.wfile.write(chunk)
            except OSError:
                self._drop_upstream()  # upstream conn is mid-body; unusable
                raise
        self._finish_upstream(resp)

    def _finish_upstream(self, resp: http.client.HTTPResponse) -> None:
        if resp.will_close:
            self._drop_upstream()

    def _rewrite_location(self, value: str) -> str:
        proxy = self.server.proxy
        if value.startswith(proxy.upstream):
            return proxy.endpoint + value[len(proxy.upstream) :]
        return value

    # -- responses ---------------------------------------------------------
    def _start_response(self, status: int, reason: str, headers: list[tuple[str, str]]) -> None:
        self.send_response_only(status, reason or None)
        for name, value in headers:
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()

    def _send_simple(self, status: int, body: bytes, ctype: str) -> None:
        headers = [("Content-Type", ctype), ("Content-Length", str(len(body)))]
        if self.command == "HEAD":
            body = b""
        self._start_response(status, "", headers)
        if body:
            self.wfile.write(body)

    def _send_error_response(self, status: int) -> None:
        code, message = _ERRORS.get(status, (f"Error{status}", f"Injected error {status}"))
        if self.path.startswith(_GCS_PREFIXES):
            doc = {
                "error": {
                    "code": status,
                    "message": message,
                    "errors": [{"reason": code, "message": message}],
                }
            }
            self._send_simple(status, json.dumps(doc).encode(), "application/json")
        else:
            xml = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{code}</Code><Message>{message}</Message>"
                "<RequestId>FAULTPROXY</RequestId></Error>"
            )
            self._send_simple(status, xml.encode(), "application/xml")


class FaultProxy:
    """Reverse proxy on 127.0.0.1 that injects faults per a :class:`FaultPlan`.

    ``on_request(method, target)`` runs for every request after its body has
    been read and before it is forwarded (or faulted). With ``hold`` set,
    requests whose target contains it additionally wait on :attr:`release`
    (up to 30 s) after the hook ran, so a test can kill the client while its
    request is provably in flight; :attr:`held` is set when that happens.
    After release the request is forwarded (``hold_action="forward"``) or the
    client connection is closed without forwarding (``"drop"``).
    """

    def __init__(
        self,
        upstream: str,
        plan: FaultPlan | None = None,
        *,
        on_request: Callable[[str, str], None] | None = None,
        hold: str | None = None,
        hold_action: str = "forward",
    ) -> None:
        parsed = urllib.parse.urlsplit(upstream)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"upstream must be an http:// URL, got {upstream!r}")
        if hold_action not in ("forward", "drop"):
            raise ValueError("hold_action must be 'forward' or 'drop'")
        self.upstream = f"http://{parsed.netloc}"
        self._upstream_host = parsed.hostname
        self._upstream_port = parsed.port or 80
        self._upstream_prefix = parsed.path.rstrip("/")
        self.on_request = on_request
        self.hold = hold
        self.hold_action = hold_action
        self.release = threading.Event()
        self.held = threading.Event()
        self._lock = threading.Lock()
        self._plan = plan or FaultPlan()
        self._rng = random.Random(self._plan.seed)
        self._plan_faults = 0
        self._requests = 0
        self._faults: dict[str, int] = {}
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        """Bind a free port and serve in a daemon thread."""
        if self._server is not None:
            return
        self._stopping.clear()
        self._server = _Server(self)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"FaultProxy:{self._server.server_port}",
            daemon=True,
        )
        self._thread.start()
        logger.debug("fault proxy %s -> %s", self.endpoint, self.upstream)

    def stop(self) -> None:
        """Stop serving and cut open connections; does not wait for handlers."""
        server, self._server = self._server, None
        if server is None:
            return
        self._stopping.set()
        self.release.set()  # unblock held requests
        server.shutdown()
        server.cut_all()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def port(self) -> int:
        """Port the proxy listens on; only valid after start()."""
        if self._server is None:
            raise RuntimeError("fault proxy is not started")
        return int(self._server.server_port)

    @property
    def endpoint(self) -> str:
        """Base URL clients should use instead of the upstream's."""
        return f"http://127.0.0.1:{self.port}"

    # -- plan and counters -------------------------------------------------
    @property
    def plan(self) -> FaultPlan:
        """The plan currently in force."""
        with self._lock:
            return self._plan

    def set_plan(self, plan: FaultPlan) -> None:
        """Swap the plan atomically; the RNG and ``max_faults`` budget restart."""
        with self._lock:
            self._plan = plan
            self._rng = random.Random(plan.seed)
            self._plan_faults = 0

    @property
    def requests(self) -> int:
        """Requests received (faulted or not)."""
        with self._lock:
            return self._requests

    @property
    def faults(self) -> dict[str, int]:
        """Injected faults by kind ("slowdown", ..., or "permanent"); a copy."""
        with self._lock:
            return dict(self._faults)

    def reset_counters(self) -> None:
        """Zero ``requests`` and ``faults`` (the plan's fault budget is kept)."""
        with self._lock:
            self._requests = 0
            self._faults = {}

    # -- called from handler threads ---------------------------------------
    def _decide(self, target: str) -> tuple[int | str | None, float]:
        """Return (action, latency): action None = forward, else a kind/status."""
        with self._lock:
            self._requests += 1
            plan = self._plan
            if plan.match is not None and plan.match not in target:
                return None, 0.0
            if plan.max_faults is not None and self._plan_faults >= plan.max_faults:
                return None, plan.latency_s
            action: int | str | None = None
            kind = ""
            if plan.permanent_status is not None:
                action, kind = plan.permanent_status, "permanent"
            elif plan.error_rate > 0 and self._rng.random() < plan.error_rate:
                kind = self._rng.choice(plan.kinds)
                action = _KIND_STATUS.get(kind, kind)
            if action is not None:
                self._plan_faults += 1
                self._faults[kind] = self._faults.get(kind, 0) + 1
            return action, plan.latency_s

    def _notify(self, method: str, target: str) -> None:
        hook = self.on_request
        if hook is None:
            return
        try:
            hook(method, target)
        except Exception:
            logger.exception("fault proxy: on_request hook failed")

    def _should_hold(self, target: str) -> bool:
        return self.hold is not None and self.hold in target and not self._stopping.is_set()
