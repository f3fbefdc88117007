"""Properties of the upload window (cloudckpt/storage/transfer/window.py), generated
by hypothesis: waiting acquires on many threads never hold more than the window
(but a lone request larger than all of it), and the mappings the window keeps
plus the bytes in use fit it whenever a fresh mapping is made."""

from __future__ import annotations

import mmap
import threading
import time

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from cloudckpt.storage.transfer.window import ByteWindow

#: Bounded and reproducible, for a loaded CI machine (threads wait on each other:
#: no per-example deadline).
BOUNDED = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow])


class _Watched(ByteWindow):
    """A window that checks every change of ``used`` as it is made (under the
    window's lock): bytes may go past the capacity only from an empty window, for
    a request that then runs alone."""

    def __init__(self, capacity: int) -> None:
        self.value = 0
        self.breaches: list[tuple[int, int]] = []
        super().__init__(capacity)

    @property
    def used(self) -> int:
        return self.value

    @used.setter
    def used(self, new: int) -> None:
        old, self.value = self.value, new
        if new > old and new > self.capacity and old != 0:
            self.breaches.append((old, new))


@st.composite
def _request(draw: st.DrawFn) -> int:
    """Bytes of one request: within any window drawn, now and then past all of them
    (hypothesis favours the first of a choice)."""
    if draw(st.sampled_from([False] * 7 + [True])):
        return draw(st.integers(65, 200))
    return draw(st.integers(1, 24))


#: A thread's requests, one held at a time.
_REQUESTS = st.lists(_request(), min_size=1, max_size=12)


@BOUNDED
@given(capacity=st.integers(24, 64), threads=st.lists(_REQUESTS, min_size=2, max_size=4),
       holds=st.lists(st.sampled_from([0.0, 0.0, 0.0005]), min_size=1, max_size=4))
def test_waiting_acquires_never_hold_more_than_the_window(capacity, threads, holds):
    """Threads take and give back bytes of every size at once: at no change of
    ``used`` does it pass the capacity, unless an oversized request took an empty
    window; the peak says the same, every thread gets through, and every byte
    comes back."""
    window = _Watched(capacity)
    failures: list[BaseException] = []

    def run(sizes: list[int], hold: float) -> None:
        try:
            for n in sizes:
                got = window.acquire(n)
                time.sleep(hold)  # 0: just a switch of threads
                window.release(got)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)

    workers = [threading.Thread(target=run, args=(sizes, holds[i % len(holds)]), daemon=True)
               for i, sizes in enumerate(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(60)
    assert not any(t.is_alive() for t in workers), "a waiting acquire was never let in"
    assert not failures, failures
    assert not window.breaches, f"bytes past the window from a non-empty one: {window.breaches}"
    assert window.used == 0
    largest = max(n for sizes in threads for n in sizes)
    event("an oversized request" if largest > capacity else "all within the window")
    assert window.peak <= max(capacity, largest)
    if largest <= capacity:
        assert window.peak <= capacity


class _Held:
    """Bytes a writer holds, and the mapping that holds their copy, if any."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.mapped: mmap.mmap | None = None


class WindowMappings(RuleBasedStateMachine):
    """One writer's steps in any order: take bytes (waiting acquires that do not
    wait), map them, give bytes and mappings back together or apart. The window
    keeps what it was given back exactly while kept plus used fit, hands a kept
    mapping out again before making one, and a fresh mapping leaves kept plus used
    within the capacity."""

    holds = Bundle("holds")

    @initialize(capacity=st.integers(16, 64))
    def open(self, capacity: int) -> None:
        self.window = ByteWindow(capacity)
        self.used = 0
        self.kept: list[mmap.mmap] = []  # what the window keeps, by our count
        self.live: list[_Held] = []

    @rule(target=holds, n=st.sampled_from([8, 16, 24, 8, 16, 80]))
    def acquire(self, n: int) -> _Held:
        if self.used and self.used + n > self.window.capacity:
            n = self.window.capacity - self.used  # what fits: the call must not wait
        if n <= 0:
            return _Held(0)
        assert self.window.acquire(n) == n
        self.used += n
        held = _Held(n)
        self.live.append(held)
        return held

    @rule(held=holds, fraction=st.sampled_from([1.0, 1.0, 0.5]))
    def map(self, held: _Held, fraction: float) -> None:
        if held.n == 0 or held.mapped is not None or held not in self.live:
            return
        size = max(1, int(held.n * fraction))
        reusable = [m for m in self.kept if len(m) == size]
        mapped = self.window.mapping(size)
        assert len(mapped) == size and not mapped.closed
        evicted = any(m.closed for m in self.kept)
        self.kept = [m for m in self.kept if not m.closed]  # evicted ones are unmapped
        if reusable:
            assert mapped in reusable, "a fresh mapping where a kept one fitted"
            self.kept.remove(mapped)
            event("a kept mapping handed out again")
        else:
            event(f"a fresh mapping, {'after evicting' if evicted else 'none kept'}")
            assert all(m is not mapped for m in self.kept)
            capacity = self.window.capacity
            if self.used <= capacity:
                assert self.window.kept + self.used <= capacity
            else:  # a lone oversized request
                assert self.window.kept == 0
        held.mapped = mapped

    @rule(held=consumes(holds), keep=st.booleans())
    def release(self, held: _Held, keep: bool) -> None:
        if held not in self.live:
            return
        self.live.remove(held)
        mapped, held.mapped = held.mapped, None
        back = mapped if keep else None
        size, before = 0 if back is None else len(back), self.window.kept
        self.window.release(held.n, keep=back)
        self.used -= held.n
        if mapped is not None and back is None:
            mapped.close()
        self._check_given_back(back, size, before)

    @rule(held=holds)
    def keep(self, held: _Held) -> None:
        if held.mapped is None or held not in self.live:
            return
        mapped, held.mapped = held.mapped, None
        size, before = len(mapped), self.window.kept
        self.window.keep(mapped)
        self._check_given_back(mapped, size, before)

    def _check_given_back(self, mapped: mmap.mmap | None, size: int, before: int) -> None:
        """The window kept ``mapped`` (``size`` bytes, given back when it kept
        ``before``) if it fits beside what is used and kept, else unmapped it."""
        if mapped is None:
            assert self.window.kept == before
        elif self.used + before + size <= self.window.capacity:
            assert self.window.kept == before + size and not mapped.closed
            self.kept.append(mapped)
            event("given back and kept")
        else:
            assert self.window.kept == before and mapped.closed
            event("given back and unmapped")

    @invariant()
    def counts_agree(self) -> None:
        if not hasattr(self, "window"):
            return
        assert self.window.used == self.used
        assert self.window.kept == sum(len(m) for m in self.kept)
        assert self.window.kept <= self.window.capacity

    def teardown(self) -> None:
        for held in getattr(self, "live", []):
            if held.mapped is not None:
                held.mapped.close()
        for m in getattr(self, "kept", []):
            m.close()


WindowMappings.TestCase.settings = settings(BOUNDED, max_examples=100,
                                           stateful_step_count=30)
test_window_keeps_mappings_within_its_capacity = WindowMappings.TestCase
