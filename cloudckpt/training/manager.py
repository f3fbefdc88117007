"""CheckpointManager: when to save, what to keep, sync or async, and resume.

Policies are small objects of their own — :class:`SaveSchedule` (when),
:mod:`cloudckpt.core.retention` (what to keep) — and the manager only wires them
to the mechanisms (:mod:`cloudckpt.training.snapshot` checkpoints, the
commit protocol, retries).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from torch.distributed.checkpoint.planner import LoadPlanner

from cloudckpt.core.checkpoint import Checkpoint
from cloudckpt.core.listing import CheckpointInfo, list_checkpoints, newest
from cloudckpt.core.profiles import FULL, PROFILES, WEIGHTS, Profile, check_name
from cloudckpt.core.retention import Managed, apply_retention
from cloudckpt.dcp import devicecopy
from cloudckpt.dcp.budget import BudgetStager, StagedState
from cloudckpt.errors import (
    CloudCkptError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from cloudckpt.runtime import coordination as coord
from cloudckpt.runtime import interrupts
from cloudckpt.runtime.pending import SaveFuture, run_in_background
from cloudckpt.runtime.preemption import Notice
from cloudckpt.runtime.state import StepInfo
from cloudckpt.storage import Store, as_store, open_below
from cloudckpt.storage.transfer.tally import Tally, counting
from cloudckpt.training import reports, tiers
from cloudckpt.training import snapshot as training
from cloudckpt.training.options import ManagerOptions
from cloudckpt.training.reports import Timing
from cloudckpt.training.schedule import SaveSchedule, Schedules

log = logging.getLogger(__name__)

_SCHEDULE = "__schedule__"


class CheckpointManager:
    """Saves training checkpoints below ``root`` when due, keeps what the policy
    says, and restores the newest good one.

    >>> mgr = CheckpointManager("s3://bucket/run", ManagerOptions(every_steps=100, keep_last=3))
    >>> info = mgr.restore(state) or StepInfo(steps_per_epoch=len(loader))  # doctest: +SKIP
    >>> mgr.save(info, state, extra={"sched": sched}, per_rank={"data": loader})  # doctest: +SKIP

    Call every method on every rank. With ``async_save`` the call returns once
    the state is staged to host memory; the next save, :meth:`wait` or
    :meth:`close` raises any error of the background upload. A save still
    running when the process ends is waited for, or reported with an ERROR and
    the exit status (see :mod:`cloudckpt.runtime.pending`).
    """

    def __init__(self, root: str | Store, options: ManagerOptions | None = None, *,
                 storage_options: Mapping[str, Any] | None = None,
                 process_group: Any = None) -> None:
        self.options = options or ManagerOptions()
        self._storage_options = dict(storage_options or {})
        self.store = as_store(root, storage_options)
        self.group = process_group
        #: This manager's checkpoints of each save profile: training checkpoints named by
        #: ``ManagerOptions.name_format_of(profile)``. Only these are restored from or
        #: deleted by retention (each profile's apart); others in the root are left be.
        self.managed_by_profile = {p: Managed.from_format(
            training.KIND, self.options.name_format_of(p)) for p in PROFILES}
        #: Its ``full`` checkpoints (``name_format``).
        self.managed = self.managed_by_profile[FULL]
        self.schedule = SaveSchedule(self.options.every_steps, self.options.every_epochs,
                                     self.options.every_seconds, group=process_group)
        tier = self.options.local
        self._local = tiers.LocalCopies(tier, self.managed, process_group,
                                        incremental=self.options.incremental) if tier else None
        weights = self.options.weights_every_steps
        self._schedules = Schedules(self.schedule, SaveSchedule(tier.every_steps)
                                    if tier else None,
                                    SaveSchedule(weights) if weights else None)
        # Background saves and drains run collectives on a group of their own.
        background = self.options.async_save or bool(tier and (tier.drain_every or
                                                                  tier.replicas))
        self._io_group = coord.new_cpu_group() if background else process_group
        self._draining: str | None = None
        self._local_steps: list[int] = []  # this process's local saves, and the newest
        self._in_bucket = -1  # step it committed to the bucket (a drain's or a save's)
        self._notice = Notice(self.options.preemption) if self.options.preemption else None
        if self._notice is not None:
            self._notice.install()
        #: Set once a preemption save ran: the training loop should stop.
        self.preempted = False
        self._stager: BudgetStager | None = None
        self._pending: SaveFuture | None = None
        self._closed = False

    @property
    def uri(self) -> str:
        return self.store.uri

    # ------------------------------------------------------------------ saving

    def should_save(self, step_info: StepInfo) -> bool:
        """Advance the schedule by one step (and an epoch at an epoch's last step)."""
        epoch_end = step_info.epoch_step == step_info.steps_per_epoch - 1
        return self.schedule.check(steps=1, epochs=int(epoch_end))

    @interrupts.watching()
    def save(self, step_info: StepInfo, state_dict: Mapping[str, Any], *,
             extra: Mapping[str, Any] | None = None, per_rank: Mapping[str, Any] | None = None,
             rng: bool = True, force: bool = False, profile: str | None = None) -> bool:
        """Save if a schedule says so (or ``force``); return whether a save started.

        The bucket schedule's save (or ``force``'s) is of ``profile`` (None:
        ``ManagerOptions.profile``); a step only ``weights_every_steps`` takes is a
        ``weights`` save (see :mod:`cloudckpt.core.profiles`). With a local tier, a step
        the bucket's schedule does not take but the tier's does is saved locally (see
        :class:`LocalTier`), always ``full``."""
        if self._closed:
            raise ConfigError("this CheckpointManager is closed")
        if profile is not None:
            check_name(profile)
        timing = Timing()
        notice = coord.all_reduce_max(self._notice.code, self.group) if self._notice else 0.0
        if notice:
            self._save_on_preemption(step_info, state_dict, notice, extra=extra,
                                     per_rank=per_rank, rng=rng)
            return True
        due = self.should_save(step_info) or force
        local_due = self._schedules.local is not None and self._schedules.local.check(
            steps=1, epochs=0)
        weights_due = self._schedules.weights is not None and self._schedules.weights.check(
            steps=1, epochs=0)
        if not (due or local_due or weights_due):
            return False
        # The bucket's save of this step, if any: a full save holds the weights too.
        kind = (profile or self.options.profile) if due else WEIGHTS if weights_due else None
        if due or (self._pending is not None and self._pending.done()):
            self.wait()  # one bucket write at a time; surfaces the previous one's error
        if local_due and not due:
            self._schedules.local_saves += 1  # before the capture: a resume counts on from it
            captured = training.capture_together(
                app_state=state_dict, step_info=step_info, shared=self._shared(extra),
                per_rank=per_rank, rng=rng, group=self.group)
            self._save_local(self.options.name_of(FULL, step_info.global_step), state_dict,
                             captured, step_info.global_step, timing)
            if kind is None:
                return True
            timing = Timing()
        assert kind is not None
        self.wait()
        self._save_bucket(kind, step_info, state_dict, timing, extra=extra, per_rank=per_rank,
                          rng=rng)
        return True

    def _save_bucket(self, kind: str, step_info: StepInfo, state_dict: Mapping[str, Any],
                     timing: Timing, *, extra: Mapping[str, Any] | None,
                     per_rank: Mapping[str, Any] | None, rng: bool) -> None:
        """One bucket save of this step with profile ``kind``: a partial one holds what
        ``ManagerOptions.selection`` keeps of ``state_dict``, the step and the schedules,
        and records what it lacks."""
        selection = self.options.selection
        record = Profile()
        if kind == FULL:
            saved: Mapping[str, Any] = state_dict
            captured = training.capture_together(
                app_state=state_dict, step_info=step_info, shared=self._shared(extra),
                per_rank=per_rank, rng=rng, group=self.group)
        else:
            saved = coord.checked(lambda: selection.select(state_dict, kind), self.group)
            record = Profile(kind, selection.lacks(
                kind, state_dict, [*(extra or {}), *(per_rank or {})]))
            captured = training.capture_together(
                app_state=saved, step_info=step_info, shared=self._shared(None), rng=False,
                group=self.group)
        step = step_info.global_step
        name = self.options.name_of(kind, step)
        if not self.options.async_save:
            self._write(name, saved, captured, step, timing=timing, profile=record)
            return
        if self._stager is None:
            self._stager = BudgetStager(self.options.staging_budget)
        staged = self._stager.stage(dict(saved))
        self._pending = run_in_background(
            lambda: self._write(name, staged.state_dict, captured, step, staged, timing,
                                profile=record), f"async save to {self.store.child(name).uri}")
        self._pending.add_done_callback(lambda _: staged.release())
        staged.wait()  # the tensors that did not fit in the budget are written
        timing.blocked = time.monotonic() - timing.start

    def request_preemption_save(self) -> None:
        """Save at the next :meth:`save` call, within the preemption budget, and return
        (for a framework that handles the signals itself); needs ``preemption``."""
        if self._notice is None:
            raise ConfigError("request_preemption_save() needs ManagerOptions(preemption="
                              "Preemption(...))")
        self._notice.request()

    def _save_on_preemption(self, step_info: StepInfo, state_dict: Mapping[str, Any],
                            notice: float, **what: Any) -> None:
        """One bucket save of this step on every rank, committed by the deadline or not
        at all; then the signal goes on (the process ends as it would have)."""
        assert self._notice is not None
        self.preempted = True
        deadline = (self._notice.deadline if self._notice.noticed_at is not None
                    else time.monotonic() + self._notice.policy.budget)
        name = self.options.name_format.format(step=step_info.global_step)
        timing = Timing()
        try:
            self._finish_pending(deadline)
            captured = training.capture_together(
                app_state=state_dict, step_info=step_info, shared=self._shared(what.pop("extra")),
                group=self.group, **what)
            self._write(name, state_dict, captured, step_info.global_step, timing=timing,
                        op="preemption save", deadline=deadline)
            log.warning("preemption save committed: %s in %.1f s (budget %.0f s)",
                        self.store.child(name).uri, time.monotonic() - timing.start,
                        self._notice.policy.budget)
        except CloudCkptError as exc:
            log.error("preemption save of %s NOT committed: %s", name, exc)
        finally:
            self._notice.proceed(int(notice) if notice >= 1 else None)

    def _shared(self, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        """The shared state a checkpoint holds: the user's ``extra`` and the schedules."""
        return {**dict(extra or {}), _SCHEDULE: self._schedules}

    def _finish_pending(self, deadline: float) -> None:
        """Wait for the pending save or drain until ``deadline``."""
        pending, self._pending, self._draining = self._pending, None, None
        if pending is None:
            return
        try:
            pending.result(max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise IncompleteCheckpointError(
                f"{pending.what} was still running at the preemption deadline") from None
        except CloudCkptError as exc:  # its own loss, reported; this save goes on
            log.error("%s failed, NOT committed: %s", pending.what, exc)

    def _write(self, name: str, state_dict: Mapping[str, Any], captured: training.Captured,
               step: int, staged: StagedState | None = None, timing: Timing | None = None,
               op: str = "save", deadline: float | None = None,
               profile: Profile | None = None) -> Checkpoint | None:
        timing, profile = timing or Timing(), profile or Profile()
        with counting() as tally:
            ckpt = training.write(
                self.store.child(name), state_dict, captured,
                training.WriteOptions(step=step, deadline=deadline, profile=profile,
                                      incremental=self.options.incremental, index=True),
                group=self._io_group, staged=staged,
                figures=reports.Figures(timing.start, tally))
            durable = time.monotonic() - timing.start
            self._retain(name, profile.name)
        self._in_bucket = max(self._in_bucket, step)
        self._report(op, "bucket", step, self.store.child(name).uri, timing, tally, ckpt,
                     durable, self._io_group)
        return ckpt

    def _report(self, op: str, tier: str, step: int | None, uri: str, timing: Timing,
                tally: Tally, ckpt: Checkpoint | None, durable: float, group: Any) -> None:
        """Gather every rank's figures; rank 0 logs the report and hands it on."""
        ranks = reports.gather(timing.start, tally, group, ckpt)
        blocked = timing.blocked if timing.blocked is not None else (
            time.monotonic() - timing.start)
        reports.deliver(reports.report(op, tier, step, uri, ranks, blocked_s=blocked,
                                       durable_s=durable, group=group), self.options.on_report)

    def _retain(self, name: str, kind: str = FULL) -> None:
        """Retention in the bucket after ``name``, a save of profile ``kind``, committed
        there, among that profile's saves alone; it never fails the save: it warns and
        the next save retries."""
        coord.on_coordinator(lambda: apply_retention(
            self.store, self.options.keep_last, self.options.keep_every,
            number=self.managed_by_profile[kind], keep=name),
            self._io_group)

    def _save_local(self, name: str, state_dict: Mapping[str, Any],
                    captured: training.Captured, step: int, timing: Timing) -> None:
        """Every rank commits its own local checkpoint; every rank learns whether all
        did. Every ``drain_every``-th one then drains to the bucket in the background."""
        local = self._local
        assert local is not None and self._schedules.local is not None
        saved: list[Checkpoint] = []
        try:
            with counting() as tally:
                coord.each_rank(lambda: saved.append(local.save(name, state_dict, captured,
                                                                step)), self.group)
        except BaseException:
            self._schedules.local_saves -= 1  # the failed save does not count to a drain
            raise
        ckpt = saved[0]
        drain_every = local.tier.drain_every
        drain = bool(drain_every and self._schedules.local_saves % drain_every == 0)
        plan = local.plan(self.group) if local.replicas is not None else None
        if drain or (plan is not None and self._pending is not None):
            self.wait()  # the previous drain, copy or async save, before this one starts
        self._local_steps.append(step)
        local.retain({name} | ({self._draining} if self._draining else set()))
        held = coord.each_rank(lambda: (local.host, sorted(local.steps())), self.group)
        coord.on_coordinator(lambda: tiers.write_record(self.store, held), self.group)
        durable = time.monotonic() - timing.start
        timing.blocked = durable
        self._report("save", "local", step, ckpt.uri, timing, tally, ckpt, durable, self.group)
        if drain:
            self._draining = name
        if drain or plan is not None:
            what = " and ".join(([f"copy to partners of the local checkpoint {name}"]
                                 if plan is not None else []) +
                                ([f"drain of the local checkpoint {name} to "
                                  f"{self.store.child(name).uri}"] if drain else []))
            self._pending = run_in_background(
                lambda: self._after_local(ckpt, name, timing.start, plan, drain), what)

    def _after_local(self, ckpt: Checkpoint, name: str, start: float,
                     plan: list[list[int]] | None, drain: bool) -> None:
        """In the background: copy the local step to the partners, then drain it."""
        local = self._local
        assert local is not None
        if plan is not None:
            began = time.monotonic()
            local.replicate(ckpt, name, plan, self._io_group)
            if coord.rank(self._io_group) == 0:
                log.info("local tier: step %s copied to %d partner(s) a rank in %.2f s",
                         ckpt.step, len(plan[0]), time.monotonic() - began)
        if drain:
            self._drain(ckpt, name, start)

    def _drain(self, local: Checkpoint, name: str, start: float,
               deadline: float | None = None) -> Checkpoint | None:
        timing = Timing(start, blocked=0.0)
        with counting() as tally:
            ckpt = tiers.drain(local, self.store.child(name), group=self._io_group,
                               figures=reports.Figures(start, tally),
                               incremental=self.options.incremental, deadline=deadline,
                               index=True)
            durable = time.monotonic() - start
            self._retain(name)
        self._in_bucket = max(self._in_bucket, local.step or 0)
        self._report("drain", "bucket", local.step, self.store.child(name).uri, timing, tally,
                     ckpt, durable, self._io_group)
        return ckpt

    def wait(self) -> None:
        """Block until the pending async save (or drain) is committed; raise its error
        if it failed."""
        pending, self._pending, self._draining = self._pending, None, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Flush the pending save (raising its error), drain the newest local step to
        the bucket (``LocalTier.drain_at_close``; every rank must call ``close``), and
        free the staging buffers and the process's pinned pools."""
        self._close(drain=True)

    def _close(self, drain: bool) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
            only = [s for s in self._local_steps if s > self._in_bucket]
            if only and drain and self._local is not None and self._local.tier.drain_at_close:
                self._drain_at_close(max(only))
            elif only and coord.rank(self.group) == 0:
                log.warning("local tier: step(s) %s are only on the nodes' local disks, not "
                            "in the bucket: a lost node loses them", only)
        finally:
            if self._notice is not None:
                self._notice.uninstall()
                if self._notice.noticed_at is not None and not self.preempted:
                    self._notice.proceed()  # no safe point is coming: the signal goes on
            if self._stager is not None:
                self._stager.close()
            devicecopy.close_shared_pools()  # the pinned buffers GPU tensors went through

    def _drain_at_close(self, step: int) -> None:
        name, start = self.options.name_format.format(step=step), time.monotonic()
        assert self._local is not None
        tiers.drain_at_close(self._local, name, step, self.store.child(name), self.group,
                             lambda local, deadline: self._drain(local, name, start, deadline))

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        # Left by an exception, another rank may never reach close: no drain, a warning.
        self._close(drain=exc[0] is None)

    # ---------------------------------------------------------------- resuming

    def latest(self, profile: str = FULL) -> Checkpoint | None:
        """This manager's newest committed checkpoint of ``profile`` below the root (not
        checked further)."""
        managed = self.managed_by_profile[check_name(profile)]
        found = newest(self.store, [c for c in list_checkpoints(self.store)
                                    if managed(c) is not None])
        return found[1] if found else None

    def restore(self, state_dict: Mapping[str, Any], *, uri: str | None = None,
                extra: Mapping[str, Any] | None = None,
                per_rank: Mapping[str, Any] | None = None, rng: bool = True,
                planner: LoadPlanner | None = None, allow_partial: bool = False
                ) -> StepInfo | None:
        """Load the newest good checkpoint (or ``uri``) in place; return its StepInfo.

        ``uri`` relative (``"step-100"``: no scheme, not absolute) names a checkpoint
        below the root; an absolute path or a URL is taken as it is.

        ``planner`` is DCP's load planner for the model and optimizer state
        (default: DCP's ``DefaultLoadPlanner``).

        Returns None when there is nothing to resume from. Torn checkpoints
        (no manifest) are skipped with a WARNING; a corrupt one falls back to
        the previous with a WARNING, or raises with ``strict``.

        With a local tier, the newest step committed in the bucket or in the local
        tier of every rank wins (the local copy, on a tie); any rank lacking a step,
        or unable to read it, sends every rank on to an older one, then to the
        bucket. Local checkpoints newer than the step resumed from are deleted.

        Save profiles: the newest checkpoint that holds all this restore loads is taken
        (a newer ``weights`` save does not hide the last ``full`` one: an INFO names
        it). A ``uri`` naming a save that lacks some of it (:mod:`cloudckpt.core.profiles`)
        is refused with :class:`PartialCheckpointError` on every rank, nothing loaded.
        ``allow_partial`` takes the newest checkpoint of any profile and loads what it
        holds; the rest (the optimizer, the RNG, ...; an adapter's frozen weights) keeps
        its values, named in a WARNING.
        """
        timing = Timing()
        with counting() as tally:
            restored, tier = self._restore(state_dict, uri=uri, extra=extra, per_rank=per_rank,
                                           rng=rng, planner=planner, allow_partial=allow_partial)
        info = restored.step_info if restored is not None else None
        if restored is not None:
            ckpt = restored.checkpoint
            counted = ckpt if tier == "local" or coord.rank(self.group) == 0 else None
            self._report("restore", tier, ckpt.step, ckpt.uri, timing, tally, counted,
                         time.monotonic() - timing.start, self.group)
        local = self._local
        if local is not None:
            step = info.global_step if info is not None else None
            copies = local.prunes_copies(self.group)
            coord.each_rank(lambda: local.prune_after(step, copies), self.group)
        return info

    def _restore(self, state_dict: Mapping[str, Any], *, uri: str | None = None,
                 extra: Mapping[str, Any] | None = None,
                 per_rank: Mapping[str, Any] | None = None, rng: bool = True,
                 planner: LoadPlanner | None = None, allow_partial: bool = False
                 ) -> tuple[training.Restored | None, str]:
        """The restore itself, and the tier it read; :meth:`restore` then reports it
        and aligns the local tier."""
        listed: dict[str, Checkpoint] = {}  # rank 0: the manifests its listing read
        shared = self._shared(extra)
        selection = self.options.selection
        options = training.ReadOptions(rng=rng, planner=planner, allow_partial=allow_partial,
                                       how_to_allow="restore(..., allow_partial=True)",
                                       selection=selection)
        if uri is not None:
            candidates = [uri]
        else:  # one listing, on rank 0; its result or its error on every rank
            local = self._local
            asked = training.wanted(state_dict, shared, per_rank, rng, selection)

            def holds(kind: str) -> bool:
                return allow_partial or selection.may_hold(kind, asked)

            # With a local tier, the listing only tells whether the bucket holds a newer
            # step: nothing of the bucket's is read unless the local tier cannot serve.
            candidates = coord.on_coordinator(lambda: self._candidates(
                listed, holds, asked, open_newest=local is None), self.group)
            newest = self._number(candidates[0]) if candidates else None
            if local is not None:
                found = tiers.restore_newest(local, state_dict, newest, self.group,
                                             options, shared=shared, per_rank=per_rank)
                if found is not None:
                    return found, "local"
                candidates = coord.on_coordinator(
                    lambda: self._candidates(listed, holds, asked), self.group)
        for i, cand in enumerate(candidates or []):
            restored, err = None, None
            try:
                where: Store | Checkpoint = (
                    open_below(self.store, cand, self._storage_options) if uri
                    else listed.get(cand) or self.store.child(cand))
                step = self._number(cand.rstrip("/").rpartition("/")[2])
                restored = training.read(where, state_dict, replace(options, step=step),
                                         shared=shared, per_rank=per_rank, group=self.group)
            except CorruptCheckpointError as exc:
                err = exc
            try:
                coord.agree(err, self.group)  # corrupt on any rank: corrupt on every rank
            except CorruptCheckpointError as exc:
                if self.options.strict or uri is not None or i == len(candidates) - 1:
                    raise
                log.warning("checkpoint %s is corrupt (%s); falling back to the previous one",
                            cand, exc)
                continue
            assert restored is not None
            log.info("resumed from %s (step %s)", restored.checkpoint.uri,
                     restored.checkpoint.step)
            return restored, "bucket"
        return None, "bucket"

    def _profile(self, name: str) -> str | None:
        """The profile whose names ``name`` is one of (None: none of this manager's)."""
        return next((p for p, m in self.managed_by_profile.items()
                     if m.number(name) is not None), None)

    def _number(self, name: str) -> int | None:
        """The step in ``name``, one of this manager's names of any profile."""
        kind = self._profile(name)
        return self.managed_by_profile[kind].number(name) if kind is not None else None

    def _candidates(self, listed: dict[str, Checkpoint], holds: Callable[[str], bool],
                    asked: set[str], open_newest: bool = True) -> list[str]:
        """This manager's committed checkpoints of the profiles that ``holds`` what this
        restore loads (``asked``), newest first (a full one before a partial one of the
        same step). Saves of its own that never committed are WARNINGs; other kinds and
        names in the root are not its business. ``open_newest``: the newest is opened
        (and ``listed``), so that one whose manifest is gone or unreadable is not taken
        for the newest; otherwise the listing says."""
        listing = list_checkpoints(self.store, include_uncommitted=True)
        own: list[CheckpointInfo] = []
        passed: list[CheckpointInfo] = []
        for c in listing:
            kind = self._profile(c.name)
            if kind is not None and self.managed_by_profile[kind](c) is not None:
                (own if holds(kind) else passed).append(c)
            elif kind is not None and c.status in ("uncommitted", "unreadable"):
                log.warning("skipping %s: %s", c.uri,
                            c.error or "no manifest (a save that never committed)")
            else:
                log.debug("not restoring from %s: not one of this manager's checkpoints "
                          "(a %s %s)", c.uri, c.status, c.kind or "prefix")
        own.sort(key=lambda c: (self._number(c.name), self._profile(c.name) == FULL))
        if not open_newest:
            return [c.name for c in reversed(own)]
        # The newest is opened here (its manifest read once, the root index checked
        # against it); older ones, tried only if it fails, are opened when tried.
        found = newest(self.store, own)
        self._say_passed(passed, self._number(found[0].name) if found else None, asked)
        if found is None:
            return []
        own = own[:own.index(found[0]) + 1]  # those after it: gone or unreadable, skipped
        listed[found[0].name] = found[1]
        return [c.name for c in reversed(own)]

    def _say_passed(self, passed: list[CheckpointInfo], taken: int | None,
                    asked: set[str]) -> None:
        """Say which partial saves newer than the checkpoint a resume takes it passed
        over: an INFO, or a WARNING when there is none to take (the run starts afresh)."""
        newer = [c.name for c in passed if taken is None or (self._number(c.name) or 0) > taken]
        if not newer:
            return
        loads = ", ".join(sorted(asked))
        if taken is None:
            log.warning("no checkpoint below %s holds all that this resume loads (%s): "
                        "only partial saves (%s), passed over. restore(..., "
                        "allow_partial=True) resumes from the newest of them", self.uri,
                        loads, ", ".join(newer))
        else:
            log.info("resuming from step %d, passing over newer partial save(s) %s: they "
                     "lack some of what this resume loads (%s); restore(..., "
                     "allow_partial=True) takes the newest of any profile", taken,
                     ", ".join(newer), loads)
