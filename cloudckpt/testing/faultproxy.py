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

Fault kinds (:data:`FAULT_KINDS`):

- ``slowdown``/``throttle``/``internal``: answer 503 SlowDown / 429 / 500 in
  the dialect of the path (S3 XML, GCS JSON) without forwarding;
- ``reset``: read the whole request, then close the client connection with an
  RST without forwarding;
- ``reset_upload``: read about half of the request body, then RST (an upload
  torn mid-body; the server never sees it);
- ``reset_download``: forward, send the response headers and about half of the
  body, then RST. A response without a body is not sent at all: the server
  applied the request but the client never hears of it;
- ``truncate``: forward, send the headers and half of the body, then close
  cleanly (a body shorter than its Content-Length).

:meth:`FaultProxy.restart` and :meth:`FaultProxy.outage` simulate the server
going away: every open connection is cut, nothing listens for a while
(connection refused), then the proxy listens again on the same port.
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
import time
import traceback
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

from ._lifecycle import StartStop

logger = logging.getLogger(__name__)

FAULT_KINDS = (
    "slowdown",
    "throttle",
    "internal",
    "reset",
    "truncate",
    "reset_upload",
    "reset_download",
)

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
_REBIND_TIMEOUT_S = 5.0


@dataclass
class FaultPlan:
    """What the proxy should break, and how often.

    ``match`` scopes everything (faults, ``permanent_status`` and
    ``latency_s``) to requests whose target (path plus query) contains it;
    ``exclude`` spares requests whose target contains it; ``methods`` (e.g.
    ``("GET",)``) scopes it to those HTTP methods.
    ``max_faults`` bounds the faults injected under this plan, including
    ``permanent_status`` ones. ``burst`` > 1 makes each fault the first of a
    run: the next ``burst - 1`` matching requests get the same fault too (a
    throttling storm), within ``max_faults``; ``error_rate=1.0`` with
    ``max_faults=N`` is a single burst of N. ``truncate`` on a response with an
    empty body degenerates to "send headers, then close".
    """

    error_rate: float = 0.0
    kinds: tuple[str, ...] = ("slowdown",)
    permanent_status: int | None = None
    latency_s: float = 0.0
    seed: int | None = None
    match: str | None = None
    max_faults: int | None = None
    burst: int = 1
    methods: tuple[str, ...] | None = None
    exclude: str | None = None

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; use {FAULT_KINDS}")
        if not self.kinds and self.error_rate > 0:
            raise ValueError("error_rate > 0 needs at least one kind")
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError("error_rate must be within [0, 1]")
        if self.burst < 1:
            raise ValueError("burst must be >= 1")
        if self.methods is not None:
            self.methods = tuple(m.upper() for m in self.methods)

    def applies_to(self, method: str, target: str) -> bool:
        """Whether this plan's faults and latency apply to a request."""
        if self.match is not None and self.match not in target:
            return False
        if self.exclude is not None and self.exclude in target:
            return False
        return self.methods is None or method.upper() in self.methods


class _Server(http.server.ThreadingHTTPServer):
    """Threaded server that tracks client sockets so stop() can cut them."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(self, proxy: FaultProxy, port: int = 0) -> None:
        self.proxy = proxy
        #: Set when this server instance stops (stop(), or a restart/outage).
        self.stopping = threading.Event()
        self._conns: set[socket.socket] = set()
        self._rst: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(("127.0.0.1", port), _Handler)

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

    def cut_all(self) -> int:
        """Cut every open client connection (waking handler threads blocked on
        idle keep-alive reads); returns how many were open."""
        with self._conns_lock:
            conns = list(self._conns)
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return len(conns)

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
        kind, action, latency = proxy._decide(self.command, self.path)
        if action == "reset_upload":
            try:
                self._read_some_body()
            except (OSError, ValueError) as exc:
                logger.debug("fault proxy: bad request body: %s", exc)
            proxy._notify(self.command, self.path)
            self._reset()
            return
        try:
            body, chunked = self._read_body()
        except (OSError, ValueError) as exc:
            logger.debug("fault proxy: bad request body: %s", exc)
            proxy._undo(kind)  # the client went away first: nothing was injected
            self.close_connection = True
            return
        proxy._notify(self.command, self.path)
        stopping = self.server.stopping
        if proxy._should_hold(self.path):
            proxy.held.set()
            if not proxy.release.wait(_HOLD_TIMEOUT_S):
                logger.warning("fault proxy: hold on %s timed out", self.path)
            if proxy.hold_action == "drop":
                self.close_connection = True
                return
        if latency > 0 and stopping.wait(latency):
            self.close_connection = True
            return
        try:
            if action is None:
                self._forward(body, chunked)
            elif action == "reset":
                self._reset()
            elif action in ("truncate", "reset_download"):
                self._forward(body, chunked, cut=str(action))
            else:
                self._send_error_response(int(action))
        except OSError as exc:
            # Client went away (e.g. killed mid-request): nothing to answer.
            logger.debug("fault proxy: client write failed: %s", exc)
            self.close_connection = True

    def _reset(self) -> None:
        """End this connection with an RST once the handler returns."""
        self.close_connection = True
        self.server.mark_rst(self.connection)

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

    def _read_some_body(self) -> None:
        """Read about half of the request body (the first chunk's worth when chunked)."""
        te = self.headers.get("Transfer-Encoding", "")
        if "chunked" in te.lower():
            line = self.rfile.readline(65537)
            size = int(line.split(b";", 1)[0].strip() or b"0", 16) if line else 0
            self.rfile.read(size // 2)
            return
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length // 2)

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

    def _forward(self, body: bytes | None, chunked: bool, cut: str | None = None) -> None:
        """Forward the request and relay the response.

        ``cut="truncate"`` sends half of the response body then closes cleanly;
        ``cut="reset_download"`` sends half of it then RSTs (and nothing at all
        when the response has no body).
        """
        reset = cut == "reset_download"
        try:
            resp = self._send_upstream(body, chunked)
        except (OSError, http.client.HTTPException) as exc:
            logger.warning("fault proxy: upstream failed: %s", exc)
            self._drop_upstream()
            self._send_simple(502, b"upstream unavailable", "text/plain")
            return

        if self.server.stopping.is_set():
            # Restarted while the request was upstream: this connection is gone.
            resp.read()
            self._finish_upstream(resp)
            self._reset()
            return
        headers = [
            (k, self._rewrite_location(v) if k.lower() == "location" else v)
            for k, v in resp.getheaders()
            if k.lower() not in _HOP_BY_HOP
        ]
        bodyless = self.command == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
        if bodyless:
            resp.read()
            self._finish_upstream(resp)
            if reset:  # applied upstream, but the client never hears of it
                self._reset()
                return
            self._start_response(resp.status, resp.reason, headers)
            return

        length = resp.length if not resp.chunked else None
        if length is None or cut is not None:
            data = resp.read()
            self._finish_upstream(resp)
            if reset and not data:
                self._reset()
                return
            headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
            headers.append(("Content-Length", str(len(data))))
            self._start_response(resp.status, resp.reason, headers)
            if cut is not None:
                self.wfile.write(data[: len(data) // 2])
                if reset:
                    self._reset()
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


class FaultProxy(StartStop):
    """Reverse proxy on 127.0.0.1 that injects faults per a :class:`FaultPlan`.

    ``on_request(method, target)`` runs for every request after its body has
    been read and before it is forwarded (or faulted). With ``hold`` set,
    requests whose target contains it additionally wait on :attr:`release`
    (up to 30 s) after the hook ran, so a test can kill the client while its
    request is provably in flight; :attr:`held` is set when that happens.
    After release the request is forwarded (``hold_action="forward"``) or the
    client connection is closed without forwarding (``"drop"``).

    :meth:`restart` and :meth:`outage` make the endpoint go away and come back
    on the same port, as a restarted server would (the upstream keeps its state).
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
        self._burst_left = 0
        self._burst_kind = ""
        self._burst_action: int | str | None = None
        self._requests = 0
        self._faults: dict[str, int] = {}
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._port: int | None = None
        # Serialises start/stop/restart; _closed tells a pending re-listen to give up.
        self._lifecycle = threading.RLock()
        self._closed = threading.Event()
        self._wake = threading.Event()  # ends a restart's downtime early (stop, resume)
        self._outage_threads: list[threading.Thread] = []
        self.cut_connections = 0

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        """Bind a free port and serve in a daemon thread."""
        with self._lifecycle:
            if self._port is not None:
                return
            self._closed.clear()
            self._serve(0)
            logger.debug("fault proxy %s -> %s", self.endpoint, self.upstream)

    def stop(self) -> None:
        """Stop serving and cut open connections; does not wait for handlers.

        Also ends an :meth:`outage` in progress (the proxy does not come back).
        """
        with self._lifecycle:
            self._closed.set()
            self._wake.set()
            self.release.set()  # unblock held requests
            self._port = None
            self._halt()
        for t in self._outage_threads:
            if t is not threading.current_thread():
                t.join(timeout=5)
        self._outage_threads = []

    def restart(self, downtime: float = 0.0) -> None:
        """Go away and come back, as a restarted server does; blocks until back.

        Every open client connection is cut (requests in flight may or may not
        have reached the upstream), nothing listens for ``downtime`` seconds
        (clients get "connection refused"), then the proxy listens again on the
        same port. Counted as one ``"outage"`` fault. The plan is kept.
        """
        with self._lifecycle:
            if self._port is None:
                raise RuntimeError("fault proxy is not started")
            port = self._port
            with self._lock:
                self._faults["outage"] = self._faults.get("outage", 0) + 1
            self._wake.clear()
            self._halt()
        if downtime > 0:
            self._wake.wait(downtime)
        deadline = time.monotonic() + _REBIND_TIMEOUT_S
        while True:
            with self._lifecycle:
                if self._closed.is_set():
                    return
                try:
                    self._serve(port)
                    logger.debug("fault proxy back on port %d", port)
                    return
                except OSError as exc:  # e.g. EADDRINUSE while old sockets drain
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"fault proxy could not re-bind port {port}") from exc
            time.sleep(0.05)

    def outage(self, seconds: float) -> threading.Event:
        """:meth:`restart` with ``downtime=seconds`` in a background thread.

        Returns at once (safe to call from an ``on_request`` hook); the event is
        set when the proxy listens again (or the outage ended with stop()).
        """
        back = threading.Event()

        def run() -> None:
            try:
                self.restart(seconds)
            except Exception:
                logger.exception("fault proxy: restart failed")
            finally:
                back.set()

        t = threading.Thread(target=run, name="FaultProxy-outage", daemon=True)
        self._outage_threads.append(t)
        t.start()
        return back

    def resume(self) -> None:
        """End the downtime of a :meth:`restart`/:meth:`outage` in progress now."""
        self._wake.set()

    def _serve(self, port: int) -> None:
        """Listen on ``port`` (0: a free one) and serve in a daemon thread."""
        server = _Server(self, port)
        self._server = server
        self._port = int(server.server_port)
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"FaultProxy:{self._port}",
            daemon=True,
        )
        self._thread.start()

    def _halt(self) -> None:
        """Stop listening and cut every open connection; handlers are not awaited."""
        server = self._server
        if server is None:
            return
        server.stopping.set()  # wakes latency waits; in-flight responses are dropped
        server.shutdown()
        server.server_close()  # the listening socket: new connections are refused
        self._server = None
        cut = server.cut_all()
        with self._lock:
            self.cut_connections += cut
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    @property
    def port(self) -> int:
        """Port the proxy listens on; valid from start() to stop(), outages included."""
        port = self._port
        if port is None:
            raise RuntimeError("fault proxy is not started")
        return port

    @property
    def listening(self) -> bool:
        """False while stopped or in an outage."""
        return self._server is not None

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
        """Swap the plan atomically; the RNG, ``max_faults`` budget and burst restart."""
        with self._lock:
            self._plan = plan
            self._rng = random.Random(plan.seed)
            self._plan_faults = 0
            self._burst_left = 0

    @property
    def requests(self) -> int:
        """Requests received (faulted or not)."""
        with self._lock:
            return self._requests

    @property
    def faults(self) -> dict[str, int]:
        """Injected faults by kind ("slowdown", ..., "permanent", "outage"); a copy."""
        with self._lock:
            return dict(self._faults)

    def reset_counters(self) -> None:
        """Zero ``requests`` and ``faults`` (the plan's fault budget is kept)."""
        with self._lock:
            self._requests = 0
            self._faults = {}

    # -- called from handler threads ---------------------------------------
    def _decide(self, method: str, target: str) -> tuple[str, int | str | None, float]:
        """Return (kind, action, latency): action None = forward, else a kind/status."""
        with self._lock:
            self._requests += 1
            plan = self._plan
            if not plan.applies_to(method, target):
                return "", None, 0.0
            if plan.max_faults is not None and self._plan_faults >= plan.max_faults:
                return "", None, plan.latency_s
            action: int | str | None = None
            kind = ""
            if plan.permanent_status is not None:
                action, kind = plan.permanent_status, "permanent"
            elif self._burst_left > 0:
                self._burst_left -= 1
                action, kind = self._burst_action, self._burst_kind
            elif plan.error_rate > 0 and self._rng.random() < plan.error_rate:
                kind = self._rng.choice(plan.kinds)
                action = _KIND_STATUS.get(kind, kind)
                self._burst_left = plan.burst - 1
                self._burst_kind, self._burst_action = kind, action
            if action is not None:
                self._plan_faults += 1
                self._faults[kind] = self._faults.get(kind, 0) + 1
            return kind, action, plan.latency_s

    def _undo(self, kind: str) -> None:
        """Uncount a fault that could not be delivered (the client left first)."""
        if not kind:
            return
        with self._lock:
            self._plan_faults = max(0, self._plan_faults - 1)
            left = self._faults.get(kind, 0) - 1
            if left > 0:
                self._faults[kind] = left
            else:
                self._faults.pop(kind, None)

    def _notify(self, method: str, target: str) -> None:
        hook = self.on_request
        if hook is None:
            return
        try:
            hook(method, target)
        except Exception:
            logger.exception("fault proxy: on_request hook failed")

    def _should_hold(self, target: str) -> bool:
        return self.hold is not None and self.hold in target and not self._closed.is_set()
