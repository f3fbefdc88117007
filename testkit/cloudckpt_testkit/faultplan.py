"""What a :class:`~cloudckpt_testkit.faultproxy.FaultProxy` breaks: the fault kinds, the
plan (:class:`FaultPlan`) and the log of what it saw (:class:`RequestRecord`).

The kinds and the header-level behaviours are described in :mod:`.faultproxy`.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Any, NamedTuple

FAULT_KINDS = (
    "slowdown",
    "throttle",
    "internal",
    "reset",
    "truncate",
    "reset_upload",
    "reset_download",
    "lose_response",
    "corrupt_upload",
)
# Faults under which the request is still forwarded (header-level behaviours apply).
FORWARDING_KINDS = frozenset({"truncate", "reset_download", "lose_response", "corrupt_upload"})

# Removing these would break the framing of the forwarded request.
_UNSTRIPPABLE = frozenset({"host", "content-length", "transfer-encoding"})


#: A :attr:`FaultPlan.script` item: a fault kind, or ``(status, S3 error code)``.
ScriptItem = str | tuple[int, str]


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

    Header-level behaviours (each optional, scoped by ``match``/``exclude``/
    ``methods`` like everything else, applied to every matching request: not
    random, not bounded by ``max_faults``, not counted in ``faults``):

    - ``strip_headers``: request headers removed before forwarding (names
      case-insensitive), e.g. ``("If-None-Match", "If-Match")``. The body and
      its framing are forwarded unchanged; ``Host``, ``Content-Length`` and
      ``Transfer-Encoding`` cannot be stripped. A SigV4 signature that covered
      a stripped header no longer verifies (moto does not check signatures).
    - ``strip_query``: query parameters removed from the request target before
      forwarding (names case-sensitive, as S3 and GCS treat them), e.g.
      ``("ifGenerationMatch", "ifMetagenerationMatch")``; the other parameters
      are kept byte for byte.
    - ``refuse_headers`` / ``refuse_query``: a request carrying any of these
      headers (case-insensitive) / query parameters (case-sensitive) is
      answered by the proxy with ``refuse_status`` and is not forwarded. Its
      body is read in full first, so the connection stays usable. The error
      body is S3 XML (``NotImplemented`` for 501, ``InvalidArgument`` for 400,
      ``PreconditionFailed`` for 412, ...) naming the header in a ``<Header>``
      or ``<ArgumentName>`` element, or GCS JSON
      (``{"error": {"code": N, "message": ...}}``) when the path starts with a
      GCS JSON-API prefix (``/storage/v1/``, ``/upload/storage/v1/``, ...) --
      the same rule that picks the dialect of injected faults.

    Faults that do not forward (``slowdown``, ``reset``, ``permanent_status``,
    ...) take precedence over a refusal; ``truncate``/``reset_download`` cut
    the refusal's response as they would the upstream's, ``lose_response``
    drops it (RST), ``corrupt_upload`` leaves it as it is.

    ``reused_only=True`` confines faults (random, scripted and
    ``permanent_status``) to requests arriving on a client connection that has
    already served a request (a pooled, kept-alive connection); ``latency_s``
    and the header-level behaviours still apply to every matching request.

    ``script`` gives the first requests that faults apply to (under ``match``,
    ``exclude``, ``methods`` and ``reused_only``) these actions, one per request
    in order, before anything random or ``permanent_status``: each item is a
    fault kind (``"lose_response"``) or a ``(status, code)`` pair that the
    proxy answers itself without forwarding, after reading the request body
    (the connection stays usable), with an S3 XML error
    (``<Error><Code>code</Code><Message>...``; the message of a known code such
    as ``NoSuchUpload`` or ``ConditionalRequestConflict``) or GCS JSON on a GCS
    path. A ``"corrupt_upload"`` item waits for a request with a body. Scripted
    faults are counted in :attr:`FaultProxy.faults` (a pair under its code, e.g.
    ``{"NoSuchUpload": 1}``) and within ``max_faults``; a lone pair may be given
    as ``script=(409, "ConditionalRequestConflict")``.
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
    strip_headers: tuple[str, ...] = ()
    strip_query: tuple[str, ...] = ()
    #: ``(header, forwarded_as, value)``: a request carrying ``header`` is forwarded
    #: with ``forwarded_as: value`` instead (e.g. a store's own create-only header
    #: turned into ``If-None-Match: *``, so moto enforces what that store would).
    rewrite_headers: tuple[tuple[str, str, str], ...] = ()
    refuse_headers: tuple[str, ...] = ()
    refuse_query: tuple[str, ...] = ()
    refuse_status: int = 501
    reused_only: bool = False
    script: tuple[ScriptItem, ...] = ()

    def __post_init__(self) -> None:
        self.script = _script(self.script)
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
        # A lone string is one name, not a sequence of one-letter names.
        self.strip_headers = tuple(h.lower() for h in _names(self.strip_headers))
        self.refuse_headers = tuple(h.lower() for h in _names(self.refuse_headers))
        self.strip_query = _names(self.strip_query)
        self.refuse_query = _names(self.refuse_query)
        framing = _UNSTRIPPABLE.intersection(self.strip_headers)
        if framing:
            raise ValueError(f"cannot strip {sorted(framing)}: the request would be malformed")
        if not 400 <= self.refuse_status <= 599:
            raise ValueError("refuse_status must be an HTTP error status (400-599)")

    def applies_to(self, method: str, target: str) -> bool:
        """Whether this plan's faults and latency apply to a request (``reused_only``
        aside: see :meth:`faults_apply_to`)."""
        if self.match is not None and self.match not in target:
            return False
        if self.exclude is not None and self.exclude in target:
            return False
        return self.methods is None or method.upper() in self.methods

    def faults_apply_to(self, method: str, target: str, reused: bool) -> bool:
        """Whether this plan's faults apply to a request that came on a client
        connection which had (``reused``) or had not served a request before."""
        return self.applies_to(method, target) and (reused or not self.reused_only)

    def _refusal(self, headers: Any, target: str) -> tuple[str, bool] | None:
        """(name as the client spelled it, is a query parameter) of the first
        refused header or query parameter the request carries, or None."""
        if self.refuse_headers:
            for name in headers.keys():
                if name.lower() in self.refuse_headers:
                    return str(name), False
        if self.refuse_query:
            for name, _ in _query_items(target):
                if name in self.refuse_query:
                    return name, True
        return None


class RequestRecord(NamedTuple):
    """One request as the proxy received it (see :attr:`FaultProxy.request_log`)."""

    method: str
    #: Path and query exactly as the client sent them (before ``strip_query``).
    target: str
    #: The client's headers, names lower-cased (repeats joined with ", ").
    headers: dict[str, str]
    #: Injected fault kind ("slowdown", ..., "permanent"), or "" for none.
    fault: str
    #: The header/query name the request was refused for, or None.
    refused: str | None
    #: Header and query names removed before forwarding (as the client spelled them).
    stripped: tuple[str, ...]
    #: Which client connection it came on (1 for the first the proxy accepted, ...).
    connection: int = 0
    #: Whether that connection had served a request before (a kept-alive one).
    reused: bool = False


def _script(value: Any) -> tuple[ScriptItem, ...]:
    """``value`` as a tuple of checked script items (a lone kind or pair is one item)."""
    if isinstance(value, str) or (
        isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], int)
    ):
        value = (value,)
    items: list[ScriptItem] = []
    for item in value:
        if isinstance(item, str):
            if item not in FAULT_KINDS:
                raise ValueError(f"unknown fault kind {item!r} in script; use {FAULT_KINDS}")
            items.append(item)
            continue
        if (
            isinstance(item, (tuple, list))
            and len(item) == 2
            and isinstance(item[0], int)
            and isinstance(item[1], str)
            and item[1]
        ):
            status, code = int(item[0]), str(item[1])
            if not 400 <= status <= 599:
                raise ValueError(f"script item {item!r}: status must be 400-599")
            items.append((status, code))
            continue
        raise ValueError(
            f"script item {item!r} is neither a fault kind nor a (status, code) pair "
            '(e.g. "lose_response" or (404, "NoSuchUpload"))'
        )
    return tuple(items)


def _names(value: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _query_items(target: str) -> list[tuple[str, str]]:
    """(decoded name, raw piece) for each parameter of the target's query."""
    _, sep, query = target.partition("?")
    if not sep or not query:
        return []
    return [
        (urllib.parse.unquote_plus(piece.partition("=")[0]), piece)
        for piece in query.split("&")
        if piece
    ]


def without_query(target: str, names: tuple[str, ...]) -> tuple[str, list[str]]:
    """``target`` without the parameters in ``names``; (new target, names removed)."""
    items = _query_items(target)
    removed = [name for name, _ in items if name in names]
    if not removed:
        return target, []
    path = target.partition("?")[0]
    kept = [piece for name, piece in items if name not in names]
    return (f"{path}?{'&'.join(kept)}" if kept else path), removed
