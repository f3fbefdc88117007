"""Network faults at the HTTP level, against real S3 (moto) and GCS (fake-gcs-server).

A :class:`~cloudckpt_testkit.FaultProxy` sits between the client libraries
(s3fs/aiobotocore, gcsfs/aiohttp) and the server on 127.0.0.1 and breaks
requests: latency, bursts of 503 SlowDown / 429, connections reset part-way
through an upload or a download, truncated bodies, the endpoint going away and
coming back, and permanent refusals. What must hold every time:

- a transient fault is absorbed: the operation succeeds and what it wrote reads
  back bit-exact through a clean, unproxied store;
- a permanent fault (or an outage longer than ``RetryPolicy.deadline``) fails
  with a clear :class:`~cloudckpt.StorageError` within the deadline;
- nothing torn is ever visible: no manifest unless the checkpoint is complete.

Each test counts failures per trial rather than stopping at the first, reports
them with ``record`` and then asserts there are none. Seeds are fixed per trial
(and differ between the trials of a full run), so a failure replays.

Fault kinds split in two. Those that answer without forwarding (503, 429, 500,
"reset", "reset_upload") never reach the server. Those that forward and then
break the response ("reset_download", "truncate") leave the request applied
while the client sees a failure and re-sends it: S3 multipart parts and GCS
part objects are stored again under the same name, and the composed or
completed object is checked against what was written.
"""

from __future__ import annotations

import http.client
import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from cloudckpt_testkit import FakeGcsServer, FaultPlan, FaultProxy
from knobs import scale

import cloudckpt.dcp as cloud_dcp
from cloudckpt import (
    MANIFEST_NAME,
    CheckpointWriter,
    RetryPolicy,
    StorageError,
    open_checkpoint,
    open_store,
)
from cloudckpt.errors import CloudCkptError

KiB = 1024
MiB = 1024 * KiB
#: s3.py never uses parts under S3's 5 MiB minimum, and sends an object under two parts
#: as one PUT; gcs.py's parts are at least 256 KiB.
PART_SIZE = {"s3": 5 * MiB, "gcs": 256 * KiB}
#: A streamed object over two parts (S3: 5 + 5 + 1 MiB parts; GCS: 5 parts).
STREAM_SIZE = {"s3": 11 * MiB, "gcs": MiB + 1000}
STREAM = "big.bin"
PIECE = 256 * KiB  # how the streamed object is written
#: Targets of the part uploads of a streamed object (GCS: part objects, one request each).
PART_TARGET = {"s3": "uploadId=", "gcs": "uploadType=multipart"}
#: Faults answered by the proxy itself: the server never sees the request.
BEFORE_SERVER = ("slowdown", "throttle", "internal", "reset", "reset_upload")
#: Faults that let the server apply the request and break the response.
AFTER_SERVER = ("reset_download", "truncate")
#: Target of a create-only write of the manifest (GCS names the object in the body).
COMMIT_TARGET = {"s3": MANIFEST_NAME, "gcs": "ifGenerationMatch=0"}


# ------------------------------------------------------------------ fixtures


@dataclass
class Net:
    """One backend seen two ways: through the fault proxy and straight."""

    name: str
    via: dict[str, Any]  # storage options through the proxy
    clean: dict[str, Any]  # storage options straight to the server
    proxy: FaultProxy
    root: str

    def uri(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def with_retry(self, policy: RetryPolicy) -> dict[str, Any]:
        return {**self.via, "retry": policy}


@pytest.fixture(params=["s3", "gcs"])
def net(request: pytest.FixtureRequest) -> Iterator[Net]:
    backend = request.getfixturevalue(request.param)
    server = request.getfixturevalue("s3_server" if request.param == "s3" else "gcs_server")
    with FaultProxy(server.endpoint) as proxy:
        clean = {**backend.options, "part_size": PART_SIZE[backend.name]}
        via = {**clean, "endpoint_url": proxy.endpoint}
        yield Net(backend.name, via, clean, proxy, backend.root)


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Callable[[], tuple[int, int]]:
    """``logs()`` -> (our retry warnings, gcsfs's own silent retries) so far."""
    caplog.set_level(logging.WARNING, logger="cloudckpt")
    caplog.set_level(logging.DEBUG, logger="gcsfs")

    def count() -> tuple[int, int]:
        ours = inner = 0
        for r in caplog.records:
            msg = r.getMessage()
            if r.name.startswith("cloudckpt") and msg.startswith("retrying "):
                ours += 1
            elif r.name.startswith("gcsfs") and "retrying after exception" in msg:
                inner += 1
        return ours, inner

    return count


# ------------------------------------------------------------------ helpers


def workload(name: str, rng: random.Random) -> dict[str, bytes]:
    """Objects of one save: small ones for put_many, a few for put, one streamed."""
    objs = {f"many/{i:02d}.bin": rng.randbytes(rng.randint(1, 48) * KiB + i) for i in range(12)}
    for i, size in enumerate((2 * KiB, 100 * KiB, 700 * KiB)):
        objs[f"one/{i}.bin"] = rng.randbytes(size)
    objs[STREAM] = rng.randbytes(STREAM_SIZE[name])
    return objs


Stage = Callable[[str], None]


def save(opts: Mapping[str, Any], uri: str, objs: Mapping[str, bytes], *, step: int = 1,
         stage: Stage | None = None) -> None:
    """A full checkpoint save: put_many, put, a streamed object, commit.

    ``stage(name)`` runs before each part ("many", "single", "stream", "commit").
    """
    def at(name: str) -> None:
        if stage is not None:
            stage(name)

    with CheckpointWriter(uri, step=step, storage_options=opts) as w:
        at("many")
        w.put_many({k: v for k, v in objs.items() if k.startswith("many/")})
        at("single")
        for k, v in objs.items():
            if k.startswith("one/"):
                w.put(k, v)
        at("stream")
        with w.open(STREAM) as f:
            view = memoryview(objs[STREAM])
            for i in range(0, len(view), PIECE):
                f.write(view[i : i + PIECE])
        at("commit")


def attempt(fn: Callable[[], object]) -> str | None:
    """Run ``fn``; None if it succeeded, else what it raised."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - every failure is a finding here
        return f"{type(exc).__name__}: {exc}"
    return None


def check(opts: Mapping[str, Any], uri: str, objs: Mapping[str, bytes]) -> str | None:
    """None if the checkpoint at ``uri`` verifies and holds exactly ``objs``."""
    def run() -> None:
        ckpt = open_checkpoint(uri, opts)
        ckpt.verify(deep=True)
        got = dict(ckpt.iter_objects())
        if got != objs:
            bad = sorted(k for k in set(got) | set(objs) if got.get(k) != objs.get(k))
            raise AssertionError(f"content differs in {bad}")

    return attempt(run)


def committed(opts: Mapping[str, Any], uri: str) -> bool:
    return open_store(uri, opts).exists(MANIFEST_NAME)


class OnUpload:
    """``on_request`` hook: calls ``action`` once, when the ``n``-th upload request
    (PUT or POST) arrives after :meth:`arm`. The request itself is then forwarded."""

    def __init__(self, action: Callable[[], object]) -> None:
        self.action = action
        self.n = 0
        self.seen = 0
        self.fired_at: float | None = None
        self._lock = threading.Lock()

    def arm(self, n: int) -> None:
        with self._lock:
            self.n, self.seen, self.fired_at = n, 0, None

    def __call__(self, method: str, target: str) -> None:
        if method not in ("PUT", "POST") or "?delete" in target:
            return
        with self._lock:
            if not self.n:
                return
            self.seen += 1
            if self.seen != self.n:
                return
            self.n = 0
            self.fired_at = time.monotonic()
        self.action()


def run_trials(count: int, trial: Callable[[int], str | None]) -> list[str]:
    """Run ``trial(rep)`` for each repetition; the problems found, one per failed trial."""
    problems = []
    for rep in range(count):
        problem = trial(rep)
        if problem:
            problems.append(f"rep {rep}: {problem}")
    return problems


def report(record: Callable[..., Any], net: Net, case: str, trials: int,
           problems: list[str], logs: Callable[[], tuple[int, int]], **detail: Any) -> None:
    ours, inner = logs()
    faults = net.proxy.faults
    record("network", f"{net.name}: {case}", trials=trials, faults=sum(faults.values()),
           failures=len(problems), retries=ours, gcsfs_retries=inner, kinds=faults,
           problems=problems[:5], **detail)


# ------------------------------------------------------------------ the proxy itself


def test_fault_kinds_on_the_wire(gcs_server: FakeGcsServer, gcs: Any) -> None:
    """What each new kind does, seen with a raw HTTP client (fake-gcs-server takes
    anonymous requests): resets part-way, bursts, an outage on the same port."""
    bucket = gcs.root.split("/")[2]

    def request(port: int, method: str, path: str, body: bytes | None = None
                ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request(method, path, body=body)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def upload(port: int, name: str, body: bytes) -> tuple[int, bytes]:
        return request(port, "POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media"
                       f"&name={name}", body)

    def download(port: int, name: str) -> tuple[int, bytes]:
        return request(port, "GET", f"/storage/v1/b/{bucket}/o/{name}?alt=media")

    body = random.Random(1).randbytes(200 * KiB)
    with FaultProxy(gcs_server.endpoint) as proxy:
        # reset_upload: half the body read, then an RST; the server never sees it.
        proxy.set_plan(FaultPlan(error_rate=1.0, kinds=("reset_upload",), max_faults=1))
        with pytest.raises(OSError):
            upload(proxy.port, "torn", body)
        assert download(gcs_server.port, "torn")[0] == 404
        # reset_download on an upload: stored, but the client hears nothing.
        proxy.set_plan(FaultPlan(error_rate=1.0, kinds=("reset_download",), max_faults=1))
        with pytest.raises(OSError):
            upload(proxy.port, "applied", body)
        assert download(gcs_server.port, "applied") == (200, body)
        # reset_download on a download: the headers and part of the body, then an RST.
        proxy.set_plan(FaultPlan(error_rate=1.0, kinds=("reset_download",), max_faults=1))
        with pytest.raises((OSError, http.client.IncompleteRead)):
            download(proxy.port, "applied")
        # A burst: three 503s in a row, scoped to GETs (the upload goes through).
        proxy.set_plan(FaultPlan(error_rate=1.0, kinds=("slowdown",), burst=3, max_faults=3,
                                 methods=("GET",)))
        assert upload(proxy.port, "other", b"x")[0] == 200
        assert [download(proxy.port, "applied")[0] for _ in range(4)] == [503, 503, 503, 200]
        # An outage: refused while down, then back on the same port.
        port = proxy.port
        back = proxy.outage(0.5)
        deadline = time.monotonic() + 5
        while proxy.listening and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        assert back.wait(5) and proxy.listening and proxy.port == port
        assert download(port, "applied") == (200, body)
        assert proxy.faults == {"reset_upload": 1, "reset_download": 2, "slowdown": 3,
                                "outage": 1}


# ------------------------------------------------------------------ transient faults


def test_latency(net: Net, record: Callable[..., Any], logs: Any) -> None:
    """20-50 ms on every request: a full save and a deep verify through the proxy."""
    def trial(rep: int) -> str | None:
        rng = random.Random(100 + rep)
        net.proxy.set_plan(FaultPlan(latency_s=rng.uniform(0.02, 0.05)))
        uri, objs = net.uri(f"lat-{rep}"), workload(net.name, rng)
        return (attempt(lambda: save(net.via, uri, objs))
                or check(net.via, uri, objs) or check(net.clean, uri, objs))

    trials = scale(1, 3)
    problems = run_trials(trials, trial)
    report(record, net, "latency 20-50 ms, save + verify", trials, problems, logs,
           requests=net.proxy.requests)
    assert not problems


def test_throttling_bursts(net: Net, record: Callable[..., Any], logs: Any) -> None:
    """Several runs of consecutive 503 SlowDown / 429 answers during each save."""
    sizes, count = (3, 5), 3
    bursts: list[int] = []

    def trial(rep: int) -> str | None:
        rng = random.Random(200 + rep)
        state = {"left": 0, "next": rng.randint(1, 4), "seen": 0}
        lock = threading.Lock()

        def hook(method: str, target: str) -> None:
            # Arms a burst that starts with the next request (counting from put_many,
            # whose parallel requests share the burst as they would a real storm).
            with lock:
                state["seen"] += 1
                if not state["left"] or state["seen"] < state["next"]:
                    return
                n = rng.randint(*sizes)
                state["left"] -= 1
                state["next"] = state["seen"] + n + rng.randint(3, 8)
                bursts.append(n)
                net.proxy.set_plan(FaultPlan(error_rate=1.0, burst=n, max_faults=n,
                                             kinds=(rng.choice(("slowdown", "throttle")),)))

        def stage(name: str) -> None:
            if name == "many":
                with lock:
                    state["left"], state["seen"] = count, 0

        net.proxy.set_plan(FaultPlan())
        net.proxy.on_request = hook
        uri, objs = net.uri(f"burst-{rep}"), workload(net.name, rng)
        try:
            return (attempt(lambda: save(net.via, uri, objs, stage=stage))
                    or check(net.clean, uri, objs))
        finally:
            net.proxy.on_request = None

    trials = scale(1, 4)
    problems = run_trials(trials, trial)
    faults = net.proxy.faults
    report(record, net, "503/429 bursts during a save", trials, problems, logs, bursts=bursts)
    assert len(bursts) == count * trials
    assert faults.get("slowdown", 0) + faults.get("throttle", 0) >= sum(bursts) - bursts[-1]
    assert not problems


def test_resets_during_uploads(net: Net, record: Callable[..., Any], logs: Any) -> None:
    """Connections reset part-way through request bodies (single PUTs, put_many,
    multipart parts / GCS part objects) and responses lost after the server applied
    the request."""
    resets = ("reset_upload", "reset_download", "reset")
    rate, cap = 0.3, 8

    def trial(rep: int) -> str | None:
        seed = 300 + 10 * rep
        plans = {
            "many": FaultPlan(error_rate=rate, kinds=resets, seed=seed, max_faults=cap),
            "single": FaultPlan(error_rate=rate, kinds=resets, seed=seed + 1, max_faults=cap,
                                methods=("PUT", "POST")),
            "stream": FaultPlan(error_rate=0.4, seed=seed + 2, max_faults=cap, kinds=resets,
                                match=PART_TARGET[net.name]),
            "commit": FaultPlan(error_rate=rate, kinds=("reset_upload", "reset"), seed=seed + 3,
                                max_faults=cap),
        }
        uri, objs = net.uri(f"reset-{rep}"), workload(net.name, random.Random(seed))
        net.proxy.set_plan(FaultPlan())
        return (attempt(lambda: save(net.via, uri, objs,
                                     stage=lambda s: net.proxy.set_plan(plans[s])))
                or check(net.clean, uri, objs))

    trials = scale(1, 4)
    problems = run_trials(trials, trial)
    faults = net.proxy.faults
    report(record, net, "resets mid-upload, lost responses", trials, problems, logs)
    assert faults.get("reset_upload", 0) >= trials, faults
    assert not problems


@pytest.mark.parametrize("net", ["s3", "gcs"], indirect=True)
def test_commit_response_lost(net: Net, record: Callable[..., Any], logs: Any) -> None:
    """The server commits the manifest (create-only), but the client only sees its
    connection reset: the save must recognise its own write and succeed."""
    plan = FaultPlan(error_rate=1.0, kinds=("reset_download",), max_faults=1,
                     match=COMMIT_TARGET[net.name], methods=("PUT", "POST"))

    def trial(rep: int) -> str | None:
        uri, objs = net.uri(f"commit-{rep}"), workload(net.name, random.Random(450 + rep))
        lost = net.proxy.faults.get("reset_download", 0)
        problem = (attempt(lambda: save(
            net.via, uri, objs,
            stage=lambda s: net.proxy.set_plan(plan if s == "commit" else FaultPlan())))
            or check(net.clean, uri, objs))
        if not problem and net.proxy.faults.get("reset_download", 0) == lost:
            problem = "the commit's response was never lost"
        return problem

    trials = scale(1, 3)
    problems = run_trials(trials, trial)
    report(record, net, "manifest commit, response lost", trials, problems, logs)
    assert not problems


@pytest.mark.parametrize("net", ["s3", "gcs"], indirect=True)
def test_upload_response_lost_mid_stream(net: Net, record: Callable[..., Any],
                                         logs: Any) -> None:
    """Multipart parts / GCS part objects that the server stored, but whose response
    the client never got (reset or truncated): re-sending them must not tear the
    object. Either the save succeeds and verifies, or (where the server cannot take
    a chunk twice) it fails with a cloudckpt error and no manifest."""
    target = PART_TARGET[net.name]

    def trial(rep: int) -> str | None:
        seed = 400 + rep
        uri, objs = net.uri(f"lost-{rep}"), workload(net.name, random.Random(seed))
        plan = FaultPlan(error_rate=0.5, kinds=AFTER_SERVER, seed=seed, match=target,
                         max_faults=4)
        try:
            save(net.via, uri, objs,
                 stage=lambda s: net.proxy.set_plan(plan if s == "stream" else FaultPlan()))
        except CloudCkptError as exc:
            return f"failed ({exc!s:.200}) yet committed" if committed(net.clean, uri) else None
        except Exception as exc:  # noqa: BLE001 - a finding
            return f"not a cloudckpt error: {type(exc).__name__}: {exc!s:.200}"
        problem = check(net.clean, uri, objs)
        return f"committed, but {problem}" if problem else None

    trials = scale(1, 3)
    problems = run_trials(trials, trial)
    report(record, net, "responses lost mid multipart/parts", trials, problems, logs)
    assert sum(net.proxy.faults.values()) >= trials
    assert not problems


@pytest.mark.parametrize("kind", ["reset_download", "truncate"])
def test_faulty_reads(net: Net, kind: str, record: Callable[..., Any], logs: Any) -> None:
    """Downloads cut off part-way (RST or a short body): whole-object GETs
    (Checkpoint.read, verify) and ranged GETs (Store.get_range, get_ranges,
    Checkpoint.read_range). Every read returns exactly the stored bytes."""
    rng = random.Random(500)
    uri, objs = net.uri("reads"), workload(net.name, rng)
    save(net.clean, uri, objs)
    names = sorted(objs)
    blob = objs[STREAM]
    rate, cap = 0.4, 1000
    problems: list[str] = []
    ops_run = 0

    def trial(rep: int) -> str | None:
        nonlocal ops_run
        net.proxy.set_plan(FaultPlan(error_rate=rate, kinds=(kind,), seed=510 + rep,
                                     methods=("GET",), max_faults=cap))
        store = open_store(uri, net.via)
        ckpt = open_checkpoint(uri, net.via)
        ranges = []
        for _ in range(8):
            start = rng.randrange(len(blob) - 1)
            ranges.append((start, rng.randint(start + 1, min(len(blob), start + 2 * MiB))))
        ops: list[tuple[str, Callable[[], object], object]] = [
            *[(f"read {n}", lambda n=n: ckpt.read(n), objs[n]) for n in names[:6]],
            ("read_many", lambda: ckpt.read_many(names), {n: objs[n] for n in names}),
            ("verify", lambda: ckpt.verify(deep=True), None),
            *[(f"get_range {s}-{e}", lambda s=s, e=e: store.get_range(STREAM, s, e),
               blob[s:e]) for s, e in ranges[:4]],
            ("get_ranges", lambda: store.get_ranges([(STREAM, s, e) for s, e in ranges]),
             [blob[s:e] for s, e in ranges]),
            *[(f"read_range {s}-{e}", lambda s=s, e=e: ckpt.read_range(STREAM, s, e),
               blob[s:e]) for s, e in ranges[4:]],
        ]
        for label, op, want in ops:
            ops_run += 1
            got: list[object] = []
            error = attempt(lambda op=op, got=got: got.append(op()))
            if error:
                problems.append(f"rep {rep} {label}: {error}")
            elif want is not None and got[0] != want:
                problems.append(f"rep {rep} {label}: wrong bytes")
        return None

    run_trials(scale(1, 3), trial)
    report(record, net, f"{kind} on whole and ranged GETs", ops_run, problems, logs)
    assert net.proxy.faults.get(kind, 0) >= 2
    assert not problems


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_through_faults(net: Net, record: Callable[..., Any], logs: Any) -> None:
    """cloudckpt.dcp save and load (ranged reads) through a mix of every transient kind;
    the loaded tensors are bit-exact."""
    save_kinds = BEFORE_SERVER + AFTER_SERVER
    save_cap, load_cap = 1000, 1000
    big = (11 if net.name == "s3" else 2) * MiB // 4

    def trial(rep: int) -> str | None:
        g = torch.Generator().manual_seed(600 + rep)
        state: dict[str, Any] = {
            "big": torch.randn(big, generator=g),
            **{f"layer{i}.w": torch.randn(128, 60 + i, generator=g) for i in range(6)},
            "ids": torch.randint(0, 1 << 40, (5000,), generator=g),
            "half": torch.randn(300, 7, generator=g).to(torch.bfloat16),
            "step": rep,
        }
        uri = net.uri(f"dcp-{rep}")
        net.proxy.set_plan(FaultPlan(error_rate=0.15, kinds=save_kinds, seed=610 + rep,
                                     max_faults=save_cap))
        error = attempt(lambda: cloud_dcp.save(state, uri, storage_options=net.via, step=rep,
                                               file_size=max(4 * big, MiB)))
        if error:
            return f"save: {error}"
        net.proxy.set_plan(FaultPlan(error_rate=0.2, kinds=BEFORE_SERVER + AFTER_SERVER,
                                     seed=620 + rep, methods=("GET", "HEAD"),
                                     max_faults=load_cap))
        target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
                  for k, v in state.items()}
        error = attempt(lambda: cloud_dcp.load(target, uri, storage_options=net.via))
        if error:
            return f"load: {error}"
        for k, v in state.items():
            t = target[k]
            if isinstance(v, torch.Tensor):
                same = (isinstance(t, torch.Tensor) and t.dtype == v.dtype
                        and torch.equal(t.view(torch.uint8), v.view(torch.uint8)))
            else:
                same = t == v
            if not same:
                return f"{k} differs after load"
        problem = attempt(lambda: open_checkpoint(uri, net.clean).verify(deep=True))
        return f"verify: {problem}" if problem else None

    trials = scale(1, 3)
    problems = run_trials(trials, trial)
    report(record, net, "DCP save + load, mixed faults", trials, problems, logs)
    assert sum(net.proxy.faults.values()) >= 2 * trials
    assert not problems


# ------------------------------------------------------------------ the endpoint goes away


OUTAGE_RETRY = {"max_attempts": 1000, "initial_backoff": 0.05, "max_backoff": 0.5}


def test_outage_shorter_than_deadline(net: Net, record: Callable[..., Any], logs: Any) -> None:
    """The endpoint restarts mid-save (connections cut, refused for 1-3 s, back on the
    same port): the save rides it out and verifies."""
    policy = RetryPolicy(deadline=30.0, **OUTAGE_RETRY)
    outages: list[str] = []

    def trial(rep: int) -> str | None:
        rng = random.Random(700 + rep)
        seconds = rng.uniform(1.0, 2.0 if rep == 0 else 3.0)
        backs: list[threading.Event] = []
        trigger = OnUpload(lambda: backs.append(net.proxy.outage(seconds)))
        # Cut in during put_many, the single puts or (S3) the streamed object's parts.
        # On GCS a chunk cut after the server stored it is re-sent and appended twice
        # by the emulator: test_upload_response_lost_mid_stream covers that.
        places = [("many", rng.randint(2, 10)), ("single", 2)]
        if net.name == "s3":
            places.append(("stream", rng.randint(1, 3)))
        where, nth = rng.choice(places)
        outages.append(f"{where}#{nth} {seconds:.1f}s")
        net.proxy.on_request = trigger
        uri, objs = net.uri(f"outage-{rep}"), workload(net.name, rng)
        try:
            problem = attempt(lambda: save(net.with_retry(policy), uri, objs,
                                           stage=lambda s: trigger.arm(nth) if s == where
                                           else None))
        finally:
            net.proxy.on_request = None
            for back in backs:
                back.wait(10)
        if trigger.fired_at is None:
            return problem or f"the outage never started ({where} #{nth})"
        return problem or check(net.clean, uri, objs)

    trials = scale(1, 3)
    problems = run_trials(trials, trial)
    report(record, net, "outage 1-3 s mid-save (proxy restart)", trials, problems, logs,
           outages=outages, connections_cut=net.proxy.cut_connections)
    assert net.proxy.faults.get("outage", 0) == trials
    assert not problems


def test_gcs_server_restart_mid_save(tmp_path: Any, record: Callable[..., Any],
                                     logs: Any) -> None:
    """A real fake-gcs-server restart (filesystem backend: objects survive) during
    put_many: the save rides it out and verifies."""
    with FakeGcsServer(tmp_path / "gcs") as server:
        server.create_bucket("cloudckpt-restart")
        opts = {**server.storage_options(), "retry": RetryPolicy(deadline=30.0, **OUTAGE_RETRY)}

        def trial(rep: int) -> str | None:
            rng = random.Random(800 + rep)
            objs = {f"many/{i:02d}.bin": rng.randbytes(rng.randint(1, 300) * KiB)
                    for i in range(24)}
            uri = f"gs://cloudckpt-restart/run/step-{rep}"
            delay, downtime = rng.uniform(0.0, 0.1), rng.uniform(0.3, 1.0 if rep == 0 else 3.0)
            restarter = threading.Thread(target=lambda: (time.sleep(delay),
                                                         server.restart(downtime)))

            def run() -> None:
                with CheckpointWriter(uri, step=rep, storage_options=opts) as w:
                    w.put("first.bin", b"before the restart")
                    restarter.start()
                    w.put_many(objs)
                    w.put("last.bin", b"after the restart")

            problem = attempt(run)
            if restarter.ident is not None:
                restarter.join(30)
            everything = {**objs, "first.bin": b"before the restart",
                          "last.bin": b"after the restart"}
            return problem or check(opts, uri, everything)

        trials = scale(1, 3)
        problems = run_trials(trials, trial)
    ours, inner = logs()
    record("network", "gcs: real server restart mid-save", trials=trials, faults=trials,
           failures=len(problems), retries=ours, gcsfs_retries=inner, problems=problems[:5])
    assert not problems


# ------------------------------------------------------------------ permanent failures


@pytest.mark.parametrize("net", ["s3", "gcs"], indirect=True)
def test_outage_longer_than_deadline(net: Net, record: Callable[..., Any], logs: Any) -> None:
    """The endpoint stays away longer than the retry deadline, mid-save: the save
    raises a clear StorageError within the deadline (plus a small margin) and
    commits nothing."""
    deadline, margin = 2.0, 1.0
    policy = RetryPolicy(deadline=deadline, **OUTAGE_RETRY)
    took: list[float] = []

    def trial(rep: int) -> str | None:
        trigger = OnUpload(lambda: net.proxy.outage(deadline + 20))
        net.proxy.on_request = trigger
        uri, objs = net.uri(f"down-{rep}"), workload(net.name, random.Random(900 + rep))
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                save(net.with_retry(policy), uri, objs,
                     stage=lambda s: trigger.arm(2) if s == "single" else None)
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001 - examined below
                outcome.append(exc)

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        try:
            t0 = time.monotonic()
            while worker.is_alive() and trigger.fired_at is None and time.monotonic() - t0 < 30:
                time.sleep(0.01)
            if trigger.fired_at is None:
                worker.join(60)
                return f"the outage never started ({outcome!r:.200})"
            # Wait no longer than the deadline allows; then bring the endpoint back, so
            # a save that overran it ends (and does not outlive the test).
            worker.join(max(0.0, trigger.fired_at + deadline + margin - time.monotonic()))
            elapsed = time.monotonic() - trigger.fired_at
            if worker.is_alive():
                net.proxy.resume()
                worker.join(60)
                return (f"no error within {deadline + margin:.1f} s of the outage "
                        f"(after it ended: {outcome!r:.200})")
            took.append(round(elapsed, 2))
            exc = outcome[0] if outcome else None
            if not isinstance(exc, StorageError) or "RetryPolicy.deadline" not in str(exc):
                return f"expected a StorageError naming the deadline, got {exc!r:.300}"
            if committed(net.clean, uri):
                return "a manifest was committed"
            return None
        finally:
            net.proxy.on_request = None
            net.proxy.resume()

    trials = scale(1, 2)
    problems = run_trials(trials, trial)
    report(record, net, "outage past the retry deadline", trials, problems, logs,
           seconds_to_error=took, deadline=deadline)
    assert not problems


@pytest.mark.parametrize("status", [403, 404, 400])
def test_permanent_refusal_mid_save(net: Net, status: int, record: Callable[..., Any],
                                    logs: Any) -> None:
    """The store starts refusing mid-save (403 access denied, 404 bucket gone, 400):
    a clear StorageError at once, not after the deadline, and no manifest."""
    deadline = 10.0
    policy = RetryPolicy(deadline=deadline, **OUTAGE_RETRY)
    hint = {403: "access was denied", 404: "bucket does not exist",
            400: "the store refused the request"}[status]

    def trial(rep: int) -> str | None:
        rng = random.Random(1000 + rep)
        trigger = OnUpload(lambda: net.proxy.set_plan(FaultPlan(permanent_status=status)))
        net.proxy.set_plan(FaultPlan())
        net.proxy.on_request = trigger
        uri, objs = net.uri(f"refused-{rep}"), workload(net.name, rng)
        nth = rng.randint(2, 8)
        t0 = time.monotonic()
        try:
            save(net.with_retry(policy), uri, objs,
                 stage=lambda s: trigger.arm(nth) if s == "many" else None)
            problem: str | None = "the save succeeded"
        except StorageError as exc:
            problem = None if hint in str(exc) else f"unclear error: {exc!s:.300}"
        except Exception as exc:  # noqa: BLE001 - a finding
            problem = f"not a StorageError: {type(exc).__name__}: {exc!s:.300}"
        finally:
            net.proxy.on_request = None
            net.proxy.set_plan(FaultPlan())
        elapsed = time.monotonic() - t0
        if not problem and elapsed > deadline / 2:
            problem = f"took {elapsed:.1f} s; a refusal must not be retried"
        if not problem and committed(net.clean, uri):
            problem = "a manifest was committed"
        return problem

    trials = scale(1, 2)
    problems = run_trials(trials, trial)
    report(record, net, f"permanent {status} mid-save", trials, problems, logs)
    assert net.proxy.faults.get("permanent", 0) >= trials
    assert not problems
