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

Fault kinds (:data:`.faultplan.FAULT_KINDS`; the plan, :class:`.faultplan.FaultPlan`):

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
  cleanly (a body shorter than its Content-Length);
- ``lose_response``: forward, read the upstream's whole response (the server
  applied the request), then RST the client connection without sending any of
  it: the answer lost on the way back;
- ``corrupt_upload``: flip one byte in the middle of the request body (same
  length, same headers) and forward it: a body corrupted in flight, which a
  server verifying a checksum header (``x-amz-checksum-crc32c``, ``Content-MD5``)
  must refuse. A request without a body is never given this fault.

Every fault that answers or cuts (all but ``reset_upload``) reads the whole
request body first, so the client has sent all of it: ``slowdown`` and the other
answered errors leave the connection usable, ``reset`` is an RST before any
response, ``reset_download`` an RST mid-body. Each works the same on a fresh and
on a reused (kept-alive) client connection; ``FaultPlan(reused_only=True)``
confines faults to reused ones, where most production faults land (a pooled
connection the server or a middlebox has given up on). ``FaultPlan(script=...)``
gives the first matching requests chosen faults or error answers, in order.

Connections are kept alive on both sides, as a real S3 endpoint keeps them: each
client connection has its own upstream connection, reused from one request to
the next (every upstream response is read to its end, bodies empty or not), and
opened afresh when the upstream closed it (one it closed while idle is noticed
before reuse, or the request is sent once more on a fresh one). Upstream requests
say ``Connection: keep-alive`` (LocalStack closes each connection after one answer
unless asked not to; moto closes it anyway).
:attr:`FaultProxy.upstream_connections` counts the upstream connections opened
and :attr:`FaultProxy.client_connections` the client ones accepted; each
:class:`RequestRecord` says which client connection a request came on and
whether that connection had served a request before.

:meth:`FaultProxy.restart` and :meth:`FaultProxy.outage` simulate the server
going away: every open connection is cut, nothing listens for a while
(connection refused), then the proxy listens again on the same port.

Header-level behaviours (:class:`FaultPlan` ``strip_*``/``refuse_*``) make the
upstream look like a store with fewer features, deterministically (no
``error_rate``): ``strip_headers``/``strip_query`` remove request headers /
query parameters before forwarding (moto then behaves like an S3-compatible
store that ignores ``If-None-Match``; fake-gcs-server like one that ignores
``ifGenerationMatch``), and ``refuse_headers``/``refuse_query`` answer a request
that carries one of them with ``refuse_status`` (501 NotImplemented by default)
without forwarding it, as some S3-compatible stores do.

Every request is logged (:attr:`FaultProxy.request_log`, a list of
:class:`RequestRecord`), so tests can count what a client really sent
(:meth:`FaultProxy.count_requests`, :attr:`FaultProxy.requests_by_method`), and the
response body bytes relayed are counted (:attr:`FaultProxy.bytes_out`), so tests can
bound what a reader downloaded.
"""

from __future__ import annotations

import collections
import http.client
import http.server
import json
import logging
import random
import select
import socket
import socketserver
import struct
import threading
import time
import traceback
import urllib.parse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple
from xml.sax.saxutils import escape as xml_escape

if TYPE_CHECKING:
    pass

from cloudckpt_testkit._lifecycle import StartStop
from cloudckpt_testkit.faultplan import (
    FORWARDING_KINDS,
    FaultPlan,
    RequestRecord,
    without_query,
)

logger = logging.getLogger(__name__)

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
    409: (
        "ConditionalRequestConflict",
        "A conflicting conditional operation is currently in progress against this resource. "
        "Please try again.",
    ),
    429: ("Throttling", "Rate exceeded"),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}
# S3 error code -> message, for scripted ``(status, code)`` answers whose code is not
# the one _ERRORS gives that status.
_MESSAGES: dict[str, str] = {
    **{code: message for code, message in _ERRORS.values()},
    "NoSuchUpload": "The specified upload does not exist. The upload ID may be invalid, "
    "or the upload may have been aborted or completed.",
    "PreconditionFailed": "At least one of the pre-conditions you specified did not hold",
    "BadDigest": "The Content-MD5 or checksum value that you specified did not match "
    "what the server received.",
}
# status -> (S3 error code, GCS reason) for requests refused under refuse_headers/_query.
_REFUSALS: dict[int, tuple[str, str]] = {
    400: ("InvalidArgument", "invalid"),
    403: ("AccessDenied", "forbidden"),
    405: ("MethodNotAllowed", "methodNotAllowed"),
    412: ("PreconditionFailed", "conditionNotMet"),
    501: ("NotImplemented", "notImplemented"),
}
_KIND_STATUS = {"slowdown": 503, "throttle": 429, "internal": 500}
_COPY_CHUNK = 64 * 1024
# How long a held request waits for release before it goes on by itself: a safety for a
# test that never releases (closing the proxy releases too), long enough that a test on a
# busy machine always acts on the request first (30 s was not: a torn copy's held object
# went through, and the copy completed before the test could interrupt it).
_HOLD_TIMEOUT_S = 300.0
_REBIND_TIMEOUT_S = 5.0



class _Decision(NamedTuple):
    kind: str  # fault kind, "" for none
    action: int | str | None  # None: forward; else a fault kind or a status
    latency: float
    #: (name, is a query parameter): answer with ``refuse_status``, don't forward.
    refused: tuple[str, bool] | None = None
    refuse_status: int = 501
    #: Lower-cased header names not to forward.
    drop_headers: frozenset[str] = frozenset()
    #: The target to forward (``strip_query`` applied); None: as received.
    target: str | None = None
    #: Headers added to the forwarded request (``rewrite_headers``).
    add_headers: tuple[tuple[str, str], ...] = ()
    #: S3 error code of an answered error (a scripted pair); "": the status's own.
    code: str = ""


def _flip_middle_byte(body: bytes) -> bytes:
    """``body`` with its middle byte inverted: same length, different bytes."""
    mid = len(body) // 2
    return body[:mid] + bytes([body[mid] ^ 0xFF]) + body[mid + 1 :]


class _UpstreamConnection(http.client.HTTPConnection):
    """A connection to the upstream that counts the TCP connections it opens."""

    def __init__(self, proxy: FaultProxy, host: str, port: int, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._proxy = proxy

    def connect(self) -> None:
        super().connect()
        self._proxy._upstream_opened()

    def gone(self) -> bool:
        """Whether this idle connection is unusable: the server closed it (EOF is
        readable) or sent something unasked."""
        sock = self.sock
        if sock is None:
            return False  # not connected: the next request connects afresh
        try:
            readable, _, _ = select.select([sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)


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
        self._upstream: _UpstreamConnection | None = None
        self._conn_no = self.server.proxy._accepted()
        self._served = 0  # requests this client connection brought so far

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
        reused = self._served > 0
        self._served += 1
        decision = proxy._decide(self.command, self.path, self.headers, self._conn_no, reused)
        kind, action, latency = decision.kind, decision.action, decision.latency
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
        if action == "corrupt_upload":
            if body:
                body = _flip_middle_byte(body)
            else:  # an empty chunked body: nothing to corrupt
                proxy._undo(kind)
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
            if action is None or action in FORWARDING_KINDS:
                cut = None if action in (None, "corrupt_upload") else str(action)
                if decision.refused is not None:
                    name, is_query = decision.refused
                    self._send_refusal(decision.refuse_status, name, is_query, cut)
                else:
                    self._forward(body, chunked, cut=cut, decision=decision)
            elif action == "reset":
                self._reset()
            else:
                self._send_error_response(int(action), decision.code)
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

    def _send_upstream(
        self, body: bytes | None, chunked: bool, decision: _Decision | None = None
    ) -> http.client.HTTPResponse:
        """Send the request upstream, retrying once if a pooled conn was stale."""
        proxy = self.server.proxy
        drop = _HOP_BY_HOP
        path = self.path
        if decision is not None:
            drop = drop | decision.drop_headers
            if decision.target is not None:
                path = decision.target
        target = proxy._upstream_prefix + path
        if self._upstream is not None and self._upstream.gone():
            self._drop_upstream()  # closed by the server while idle: not worth a try
        for attempt in (0, 1):
            fresh = self._upstream is None
            if fresh:
                self._upstream = _UpstreamConnection(
                    proxy, proxy._upstream_host, proxy._upstream_port, timeout=120
                )
            conn = self._upstream
            assert conn is not None
            try:
                conn.putrequest(self.command, target, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in drop:
                        conn.putheader(name, value)
                for name, value in decision.add_headers if decision is not None else ():
                    conn.putheader(name, value)
                # LocalStack closes a connection after each answer unless asked not to.
                conn.putheader("Connection", "keep-alive")
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

    def _forward(
        self,
        body: bytes | None,
        chunked: bool,
        cut: str | None = None,
        decision: _Decision | None = None,
    ) -> None:
        """Forward the request (``decision``'s stripping applied) and relay the response.

        ``cut="truncate"`` sends half of the response body then closes cleanly;
        ``cut="reset_download"`` sends half of it then RSTs (and nothing at all
        when the response has no body); ``cut="lose_response"`` sends nothing and
        RSTs. Every upstream response is read to its end (or its connection
        dropped), so the upstream connection serves this client's next request.
        """
        reset = cut == "reset_download"
        try:
            resp = self._send_upstream(body, chunked, decision)
        except (OSError, http.client.HTTPException) as exc:
            logger.warning("fault proxy: upstream failed: %s", exc)
            self._drop_upstream()
            self._send_simple(502, b"upstream unavailable", "text/plain")
            return

        if self.server.stopping.is_set() or cut == "lose_response":
            # Restarted while the request was upstream (this connection is gone), or
            # the answer is to be lost: the upstream applied it, the client never hears.
            try:
                resp.read()
            except (OSError, http.client.HTTPException):
                self._drop_upstream()
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
            self._send_buffered(resp.status, resp.reason, headers, data, cut)
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
                self.server.proxy._sent(len(chunk))
            except OSError:
                self._drop_upstream()  # upstream conn is mid-body; unusable
                raise
        # Reading the (now empty) rest marks the response done; an empty body
        # (Content-Length: 0) is never read in the loop, and http.client refuses
        # the connection's next request until its response is read to its end.
        resp.read()
        self._finish_upstream(resp)

    def _finish_upstream(self, resp: http.client.HTTPResponse) -> None:
        """Keep the upstream connection for the next request only if it can serve one."""
        if resp.will_close or not resp.isclosed():
            self._drop_upstream()

    def _rewrite_location(self, value: str) -> str:
        proxy = self.server.proxy
        if value.startswith(proxy.upstream):
            return proxy.endpoint + value[len(proxy.upstream) :]
        return value

    # -- responses ---------------------------------------------------------
    def _send_buffered(
        self,
        status: int,
        reason: str,
        headers: list[tuple[str, str]],
        data: bytes,
        cut: str | None,
    ) -> None:
        """Send a response whose body is in memory, whole or cut (see _forward)."""
        reset = cut == "reset_download"
        if reset and not data:
            self._reset()
            return
        headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
        headers.append(("Content-Length", str(len(data))))
        self._start_response(status, reason, headers)
        if cut is not None:
            self.wfile.write(data[: len(data) // 2])
            self.server.proxy._sent(len(data) // 2)
            if reset:
                self._reset()
            self.close_connection = True
        else:
            self.wfile.write(data)
            self.server.proxy._sent(len(data))

    def _send_refusal(self, status: int, name: str, is_query: bool, cut: str | None) -> None:
        """Answer for a store that does not support header/parameter ``name``."""
        what = "query parameter" if is_query else "header"
        code, reason = _REFUSALS.get(status) or (
            _ERRORS.get(status, (f"Error{status}", ""))[0],
            "invalid",
        )
        if status == 501:
            message = f"A {what} you provided implies functionality that is not implemented"
        else:
            message = f"Unsupported {what} '{name}' received for this API call."
        if self.path.startswith(_GCS_PREFIXES):
            if status == 501:
                message = f"{message} ({name})"
            location = "parameter" if is_query else "header"
            error = {"reason": reason, "message": message, "location": name,
                     "locationType": location}  # fmt: skip
            doc = {"error": {"code": status, "message": message, "errors": [error]}}
            body, ctype = json.dumps(doc).encode(), "application/json"
        else:
            tag = "Header" if status == 501 and not is_query else "ArgumentName"
            xml = (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{code}</Code><Message>{xml_escape(message)}</Message>"
                f"<{tag}>{xml_escape(name)}</{tag}><RequestId>FAULTPROXY</RequestId></Error>"
            )
            body, ctype = xml.encode(), "application/xml"
        if self.command == "HEAD" or cut is None:
            if cut == "reset_download":  # bodyless: the client hears nothing
                self._reset()
                return
            self._send_simple(status, body, ctype)
            return
        self._send_buffered(status, "", [("Content-Type", ctype)], body, cut)

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

    def _send_error_response(self, status: int, code: str = "") -> None:
        """Answer ``status`` with an error body: S3 XML, or GCS JSON on a GCS path.

        ``code`` is the S3 error code (default: the one :data:`_ERRORS` gives the status).
        """
        default = _ERRORS.get(status, (f"Error{status}", f"Injected error {status}"))
        if code and code != default[0]:
            message = _MESSAGES.get(code, f"Injected error {status} {code}")
        else:
            code, message = default
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
                f"<Error><Code>{xml_escape(code)}</Code><Message>{xml_escape(message)}</Message>"
                "<RequestId>FAULTPROXY</RequestId></Error>"
            )
            self._send_simple(status, xml.encode(), "application/xml")


class FaultProxy(StartStop):
    """Reverse proxy on 127.0.0.1 that injects faults per a :class:`FaultPlan`.

    ``on_request(method, target)`` runs for every request after its body has
    been read and before it is forwarded (or faulted). With ``hold`` set,
    requests whose target contains it additionally wait on :attr:`release`
    (up to 300 s) after the hook ran, so a test can kill the client while its
    request is provably in flight; :attr:`held` is set when that happens.
    After release the request is forwarded (``hold_action="forward"``) or the
    client connection is closed without forwarding (``"drop"``).

    :meth:`restart` and :meth:`outage` make the endpoint go away and come back
    on the same port, as a restarted server would (the upstream keeps its state).

    Every request received is appended to :attr:`request_log` (the most recent
    ``log_limit`` are kept; ``None`` keeps all) when its headers have been
    read, before its body; :meth:`count_requests` and
    :attr:`requests_by_method` summarise it.
    """

    def __init__(
        self,
        upstream: str,
        plan: FaultPlan | None = None,
        *,
        on_request: Callable[[str, str], None] | None = None,
        hold: str | None = None,
        hold_action: str = "forward",
        log_limit: int | None = 100_000,
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
        self._by_method: dict[str, int] = {}
        self._bytes_out = 0
        self._log: collections.deque[RequestRecord] = collections.deque(maxlen=log_limit)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._port: int | None = None
        # Serialises start/stop/restart; _closed tells a pending re-listen to give up.
        self._lifecycle = threading.RLock()
        self._closed = threading.Event()
        self._wake = threading.Event()  # ends a restart's downtime early (stop, resume)
        self._outage_threads: list[threading.Thread] = []
        self.cut_connections = 0
        self._script_pos = 0  # the plan's next script item
        self._conn_serial = 0  # client connections numbered, never reset
        self._client_conns = 0
        self._upstream_conns = 0

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
            self._script_pos = 0

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

    @property
    def requests_by_method(self) -> dict[str, int]:
        """Requests received by HTTP method (``{"PUT": 3, "GET": 5}``); a copy."""
        with self._lock:
            return dict(self._by_method)

    @property
    def bytes_out(self) -> int:
        """Response body bytes relayed to clients (forwarded answers, cut ones in part)."""
        with self._lock:
            return self._bytes_out

    @property
    def upstream_connections(self) -> int:
        """TCP connections the proxy opened to the upstream: fewer than the requests
        forwarded when the upstream keeps connections alive (one per client connection
        at best), one per request when it closes each (moto answers ``Connection: close``)."""
        with self._lock:
            return self._upstream_conns

    @property
    def client_connections(self) -> int:
        """Client connections the proxy accepted."""
        with self._lock:
            return self._client_conns

    @property
    def request_log(self) -> list[RequestRecord]:
        """The requests received, oldest first (see :class:`RequestRecord`); a copy."""
        with self._lock:
            return list(self._log)

    def count_requests(
        self,
        contains: str | None = None,
        *,
        method: str | None = None,
        header: str | None = None,
    ) -> int:
        """Logged requests whose target (as sent) contains ``contains``, made
        with ``method``, carrying header ``header`` (case-insensitive); each
        criterion is optional."""
        method = method.upper() if method is not None else None
        header = header.lower() if header is not None else None
        return sum(
            (contains is None or contains in r.target)
            and (method is None or r.method == method)
            and (header is None or header in r.headers)
            for r in self.request_log
        )

    def reset_counters(self) -> None:
        """Zero ``requests``, ``requests_by_method``, ``faults``, ``bytes_out``,
        ``upstream_connections`` and ``client_connections`` and clear ``request_log``
        (the plan's fault budget and script position are kept)."""
        with self._lock:
            self._upstream_conns = 0
            self._client_conns = 0
            self._bytes_out = 0
            self._requests = 0
            self._faults = {}
            self._by_method = {}
            self._log.clear()

    # -- called from handler threads ---------------------------------------
    def _accepted(self) -> int:
        """Count a client connection accepted; returns its number."""
        with self._lock:
            self._conn_serial += 1
            self._client_conns += 1
            return self._conn_serial

    def _upstream_opened(self) -> None:
        with self._lock:
            self._upstream_conns += 1

    def _decide(
        self, method: str, target: str, headers: Any, connection: int = 0, reused: bool = False
    ) -> _Decision:
        """What to do with a request (and log it): fault, refusal, stripping.

        ``headers`` is the client's header mapping (an ``email.message.Message``);
        ``connection`` the client connection's number, ``reused`` whether it had
        served a request before.
        """
        te = str(headers.get("Transfer-Encoding", "")).lower()
        length = str(headers.get("Content-Length", "") or "0").strip()
        has_body = "chunked" in te or (length.isdigit() and int(length) > 0)
        hdrs: dict[str, str] = {}
        for name, value in headers.items():
            key = name.lower()
            hdrs[key] = f"{hdrs[key]}, {value}" if key in hdrs else value
        with self._lock:
            self._requests += 1
            self._by_method[method] = self._by_method.get(method, 0) + 1
            plan = self._plan
            kind, action, latency, code = self._draw(plan, method, target, reused, has_body)
            refused = None
            drop: frozenset[str] = frozenset()
            forward_target = None
            stripped: list[str] = []
            added: list[tuple[str, str]] = []
            if (action is None or action in FORWARDING_KINDS) and plan.applies_to(method, target):
                refused = plan._refusal(headers, target)
                if refused is None:
                    if plan.strip_headers:
                        stripped = [n for n in headers.keys() if n.lower() in plan.strip_headers]
                        drop = frozenset(n.lower() for n in stripped)
                    if plan.strip_query:
                        new_target, removed = without_query(target, plan.strip_query)
                        if removed:
                            forward_target = new_target
                            stripped.extend(removed)
                    present = {n.lower() for n in headers.keys()}
                    for src, dst, value in plan.rewrite_headers:
                        if src.lower() in present:
                            drop = drop | {src.lower(), dst.lower()}
                            added.append((dst, value))
                            stripped.append(src)
            refused_name = refused[0] if refused else None
            self._log.append(
                RequestRecord(
                    method, target, hdrs, kind, refused_name, tuple(stripped), connection, reused
                )
            )
            return _Decision(
                kind, action, latency, refused, plan.refuse_status, drop, forward_target,
                tuple(added), code,
            )

    def _draw(
        self, plan: FaultPlan, method: str, target: str, reused: bool, has_body: bool
    ) -> tuple[str, int | str | None, float, str]:
        """(kind, action, latency, S3 error code) under ``plan``: action None = forward,
        else a kind/status; the code is "" but for a scripted pair. Called with the lock
        held."""
        if not plan.applies_to(method, target):
            return "", None, 0.0, ""
        if not plan.faults_apply_to(method, target, reused):
            return "", None, plan.latency_s, ""
        if plan.max_faults is not None and self._plan_faults >= plan.max_faults:
            return "", None, plan.latency_s, ""
        action: int | str | None = None
        kind = code = ""
        if self._script_pos < len(plan.script):
            item = plan.script[self._script_pos]
            if item == "corrupt_upload" and not has_body:
                return "", None, plan.latency_s, ""  # the item waits for a body
            self._script_pos += 1
            if isinstance(item, str):
                kind, action = item, _KIND_STATUS.get(item, item)
            else:
                (action, code), kind = item, item[1]
        elif plan.permanent_status is not None:
            action, kind = plan.permanent_status, "permanent"
        elif self._burst_left > 0:
            self._burst_left -= 1
            action, kind = self._burst_action, self._burst_kind
        elif plan.error_rate > 0 and self._rng.random() < plan.error_rate:
            kind = self._rng.choice(plan.kinds)
            action = _KIND_STATUS.get(kind, kind)
            self._burst_left = plan.burst - 1
            self._burst_kind, self._burst_action = kind, action
        if action == "corrupt_upload" and not has_body:
            return "", None, plan.latency_s, ""  # nothing to corrupt
        if action is not None:
            self._plan_faults += 1
            self._faults[kind] = self._faults.get(kind, 0) + 1
        return kind, action, plan.latency_s, code

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

    def _sent(self, n: int) -> None:
        with self._lock:
            self._bytes_out += n

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
