"""The trajectory queue between rollout and learner, backed by a write-ahead log on disk.

What this is: ``TrajectoryQueue``. Rollout puts whole groups (the G samples
of one prompt, never split); the learner takes ``n`` groups for a step. A put
is acknowledged only after its record is written and fsynced, so a crash
loses at most un-acknowledged groups. Reopening the queue replays the log,
drops duplicate group ids and cuts a torn last record.

Log format (chosen over SQLite WAL so that torn-tail handling is explicit and
testable byte by byte): append-only, CRC-framed segment files; a torn last
record (never acknowledged) is truncated on recovery, anything else that fails
to parse stops with ``QueueCorruptError`` naming the file and byte offset
(nothing is skipped silently). The format is rlctl.engine.queue_log.

Consumption is not written to the log: the learner owns it. ``cursor()`` is a
small JSON value (every group below a sequence watermark, plus the few above
it, has been consumed or dropped; drop counters by reason). It is saved in
every checkpoint, and ``restore_cursor`` puts a reopened queue exactly there:
groups taken after that checkpoint are delivered again, groups consumed before
it never are.

Resolution by draw key: a learner step of the in-order modes takes the
groups of draw keys below ``key_below`` and may return short only once every
key below it is resolved (taken, dropped, or compacted away below a
checkpoint's cursor); a key not reserved yet, reserved but not put, or pending
is unresolved, so a take never mistakes "not drawn yet" for "done". Resolved
keys follow from the log and the cursor, so ``restore_cursor`` rebuilds them.

Back-pressure: a producer ``reserve``s a slot (with the group's draw key)
before generating; reservations plus buffered groups never exceed
``capacity``, and a key more than ``max_ahead`` batches ahead of the position
the driver sets (``set_version``: the policy version in async, the step count
in the in-order modes) waits -- except the batch a waiting ``take`` needs:
generated now for the step that waits, it is fresh when trained, so the
window never closes on a learner whose version stood still or whose groups
were dropped. ``put`` of an unreserved group blocks (``block=False``: raises
``QueueFull``) while the queue is full.

Compaction: ``compact(below_seq)`` deletes whole segments below the oldest
kept checkpoint's watermark (the overlapped driver calls it after a checkpoint
commits). The draw keys they held stay known through ``compacted.json``, so a
resume neither regenerates nor retrains them.

What this is not: scheduling (rlctl.engine.overlap, rlctl.engine.producers) or placement.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from rlctl.engine.queue_log import (
    Compacted, Group, QueueCorruptError, QueueError, QueueFull, QueueTimeout, compact_segments, encode_record,
    read_groups, scan_segment, segment_start, trajectory_from_dict, trajectory_to_dict, truncate_tail,
)
from rlctl.storage.durable import fsync_path

DROP_REASONS = ("stale", "ttl", "orphaned")
__all__ = ["DROP_REASONS", "Group", "QueueCorruptError", "QueueError", "QueueFull", "QueueStats", "QueueTimeout",
           "TakeResult", "TrajectoryQueue", "trajectory_from_dict", "trajectory_to_dict"]


@dataclass
class TakeResult:
    """A learner step's groups, plus what was dropped while choosing them.

    ``weighted`` lists the group ids kept beyond the staleness bound under
    ``stale_policy="reweight"`` (the caller applies importance weights to them).
    ``staleness`` is Δv per taken group, in ``groups`` order.
    """

    groups: list[Group]
    drops: dict[str, int]
    dropped_ids: list[str]
    weighted: list[str]
    staleness: list[int]
    waited_s: float
    dropped_tokens: int = 0  # response tokens of the dropped groups (generated, never trained)


@dataclass
class QueueStats:
    depth: int
    reserved: int
    oldest_age_s: float
    puts: int
    duplicates: int
    drops: dict[str, int] = field(default_factory=dict)
    log_bytes: int = 0


@dataclass(frozen=True)
class _Staleness:
    """A take's rule for dv = ``version`` - a group's policy version: beyond ``bound`` a group is dropped
    (``stale``) or, with ``reweight``, kept and listed; a group newer than the learner (generated before a
    restart rolled the version back) is dropped (``orphaned``)."""

    version: int
    bound: int | None
    reweight: bool

    def beyond(self, group: Group) -> bool:
        return self.bound is not None and self.version - group.policy_version > self.bound

    def verdict(self, group: Group) -> str | None:
        if self.version - group.policy_version < 0:
            return "orphaned"
        return "stale" if self.beyond(group) and not self.reweight else None


class TrajectoryQueue:
    """A durable FIFO of trajectory groups with idempotent puts, TTL, staleness control and back-pressure.

    Thread-safe: one lock guards the state, a condition wakes waiters. Open it
    with ``TrajectoryQueue(directory, ...)``; the constructor replays the log.
    """

    def __init__(self, directory: str | Path, *, capacity: int = 1024, batch_groups: int = 1,
                 max_ahead: int | None = None, ttl_s: float | None = None, segment_bytes: int = 64 << 20,
                 clock: Any = time.time) -> None:
        if capacity < 1:
            raise QueueError(f"queue capacity must be >= 1 (got {capacity})", "set it to at least one batch")
        self.directory = Path(directory)
        self.capacity, self.batch_groups, self.max_ahead = capacity, max(1, batch_groups), max_ahead
        self.ttl_s, self.segment_bytes, self._clock = ttl_s, segment_bytes, clock
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pending: dict[int, Group] = {}  # seq -> group, not yet consumed or dropped
        self._known: set[str] = set()  # every group id in the log (dedup)
        self._reserved: set[int] = set()  # draw keys admitted but not yet put
        self._key_floor = 0  # every draw key below this is resolved (taken, dropped or compacted)
        self._keys_above: set[int] = set()  # resolved draw keys at or above the floor
        self._version = 0
        self._learner_waiting = False  # a take is blocked waiting for groups (see _admissible)
        self._unreported: TakeResult | None = None  # what a timed-out take dropped, for the next take's result
        self._next_seq = 0
        self._puts = self._duplicates = 0
        self._drops = {r: 0 for r in DROP_REASONS}
        self._closed = False
        self._segment: Any = None
        self._segment_size = 0
        self.recovered_torn_bytes = 0
        self.directory.mkdir(parents=True, exist_ok=True)
        self._compacted = Compacted.load(self.directory)
        self._replay()
        self._mark_compacted_resolved()  # everything in the log is pending until a cursor says otherwise

    # -- recovery --------------------------------------------------------------------

    def segments(self) -> list[Path]:
        return sorted(self.directory.glob("seg-*.log"))

    def _replay(self) -> None:
        segs = self.segments()
        for i, path in enumerate(segs):
            records, torn = scan_segment(path, last=i == len(segs) - 1)
            if segment_start(path) < self._next_seq:
                raise QueueCorruptError(f"trajectory log segment {path.name} overlaps the one before it",
                                        "the log directory was edited; restore it from a backup")
            self._next_seq = segment_start(path)
            for group in read_groups(path, records, self._next_seq):
                self._next_seq += 1
                if group.group_id in self._known:
                    self._duplicates += 1
                    continue
                self._known.add(group.group_id)
                self._pending[group.seq] = group
                self._puts += 1
            if torn is not None:
                self.recovered_torn_bytes = truncate_tail(path, torn)

    # -- cursor ----------------------------------------------------------------------

    def cursor(self) -> dict[str, Any]:
        """What a checkpoint stores: consumption so far and the drop counters.

        Every log sequence below ``watermark`` and every one in ``resolved`` is
        consumed or dropped; the rest are pending.
        """
        with self._lock:
            watermark = min(self._pending, default=self._next_seq)
            resolved = [s for s in range(watermark, self._next_seq) if s not in self._pending]
            return {"watermark": watermark, "resolved": resolved, "drops": dict(self._drops)}

    def restore_cursor(self, cursor: Mapping[str, Any]) -> None:
        """Return to a checkpoint's consumption state: groups taken after it are pending again."""
        watermark = int(cursor["watermark"])
        resolved = {int(s) for s in cursor.get("resolved", ())}
        with self._cond:
            if watermark < self._compacted.below_seq:
                raise QueueError(
                    f"the checkpoint's queue cursor (watermark {watermark}) points into trajectory-log segments "
                    f"that were compacted away (everything below sequence {self._compacted.below_seq})",
                    "resume from a newer checkpoint: compaction keeps the log of every checkpoint the run keeps")
            if watermark > self._next_seq or any(s >= self._next_seq for s in resolved):
                raise QueueError(
                    f"the checkpoint's queue cursor (watermark {watermark}) is beyond the trajectory log, which "
                    f"ends at sequence {self._next_seq}",
                    "the log is older than the checkpoint (restored from another run?); resume with the run's "
                    "own directory")
            self._pending = {}
            self._key_floor, self._keys_above = 0, set()
            self._mark_compacted_resolved()
            self._replay_pending(watermark, resolved)
            self._drops = {r: int(cursor.get("drops", {}).get(r, 0)) for r in DROP_REASONS}
            self._cond.notify_all()

    def _replay_pending(self, watermark: int, resolved: set[int]) -> None:
        consumed = []
        for group in self._iter_log():
            if group.seq >= watermark and group.seq not in resolved:
                self._pending.setdefault(group.seq, group)
            else:
                consumed.append(group.key)
        self._mark_resolved(consumed)

    def _iter_log(self) -> Iterator[Group]:
        seen: set[str] = set()
        segs = self.segments()
        for i, path in enumerate(segs):
            seq = int(path.stem.split("-")[1])
            for _, payload in scan_segment(path, last=i == len(segs) - 1)[0]:
                group = Group.from_payload(payload, seq)
                seq += 1
                if group.group_id not in seen:
                    seen.add(group.group_id)
                    yield group

    # -- producer side -----------------------------------------------------------------

    def set_version(self, version: int) -> None:
        """The learner's position for admission (wakes producers waiting on ``max_ahead``); see the module docstring."""
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def reserve(self, key: int, timeout: float | None = None, block: bool = True) -> None:
        """Admit the group with draw ``key`` for generation; wait while the queue is full or too far ahead."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._admissible(key):
                if not block:
                    raise QueueFull(f"the trajectory queue is full ({self._occupancy()}/{self.capacity})",
                                    "wait for the learner or raise the queue capacity")
                self._wait(deadline, "a free queue slot")
            self._reserved.add(key)

    def release(self, key: int) -> None:
        """Give back a reservation whose group will not be put (e.g. its worker died; it is re-reserved)."""
        with self._cond:
            self._reserved.discard(key)
            self._cond.notify_all()

    def _admissible(self, key: int) -> bool:
        if self._closed:
            raise QueueError("the trajectory queue is closed")
        if self._occupancy() >= self.capacity:
            return False
        if self.max_ahead is None:
            return True
        limit = self._version + self.max_ahead
        if self._learner_waiting:  # the batch the learner waits for now is generated now: fresh when trained
            limit = max(limit, self._key_floor // self.batch_groups)
        return key // self.batch_groups <= limit

    def _occupancy(self) -> int:
        return len(self._pending) + len(self._reserved)

    def put(self, group: Group, timeout: float | None = None, block: bool = True) -> bool:
        """Append ``group`` durably; True once it is on disk, False if its id was already in the log."""
        return self.put_many([group], timeout=timeout, block=block)[0]

    def put_many(self, groups: Sequence[Group], timeout: float | None = None, block: bool = True) -> list[bool]:
        """Append several groups with one fsync; each result as for ``put``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._closed:
                raise QueueError("the trajectory queue is closed")
            fresh: list[Group] = []
            results = []
            for group in groups:
                if group.group_id in self._known or any(g.group_id == group.group_id for g in fresh):
                    self._duplicates += 1
                    self._reserved.discard(group.key)
                    results.append(False)
                    continue
                unreserved = sum(1 for g in fresh if g.key not in self._reserved)
                if group.key not in self._reserved:
                    while len(self._pending) + len(self._reserved) + unreserved >= self.capacity:
                        if not block:
                            raise QueueFull(f"the trajectory queue is full ({self._occupancy()}/{self.capacity})",
                                            "wait for the learner or raise the queue capacity")
                        self._wait(deadline, "a free queue slot")
                fresh.append(group)
                results.append(True)
            if fresh:
                self._append([g.to_payload() for g in fresh])
                for group in fresh:
                    group.seq = self._next_seq
                    self._next_seq += 1
                    self._known.add(group.group_id)
                    self._pending[group.seq] = group
                    self._reserved.discard(group.key)
                    self._puts += 1
                self._cond.notify_all()
            return results

    def _append(self, payloads: Sequence[bytes]) -> None:
        """Write and fsync; the caller acknowledges only after this returns."""
        if self._segment is None or self._segment_size >= self.segment_bytes:
            self._rotate()
        blob = b"".join(encode_record(p) for p in payloads)
        start = self._segment_size
        try:
            view = memoryview(blob)
            while view:
                view = view[os.write(self._segment, view):]
            os.fsync(self._segment)
        except OSError as err:
            os.ftruncate(self._segment, start)  # never leave an un-acknowledged record that replay would accept
            raise QueueError(f"cannot append to the trajectory log in {self.directory} ({err})",
                             "free disk space; the producer retries the same group ids") from None
        self._segment_size += len(blob)

    def _rotate(self) -> None:
        if self._segment is not None:
            os.close(self._segment)
        segs = self.segments()
        if segs and self._segment is None and segs[-1].stat().st_size < self.segment_bytes:
            path = segs[-1]  # reopened queue: keep appending to the newest segment
        else:
            path = self.directory / f"seg-{self._next_seq:012d}.log"
        self._segment = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._segment_size = os.fstat(self._segment).st_size
        fsync_path(self.directory)  # the new file's directory entry is durable before any ack

    # -- consumer side -------------------------------------------------------------------

    def take(self, n: int, current_version: int, *, max_staleness: int | None = None,
             stale_policy: str = "drop", key_below: int | None = None, min_groups: int | None = None,
             timeout: float | None = None) -> TakeResult:
        """Take ``n`` groups for the learner at ``current_version``, oldest draw key first.

        A group older than ``ttl_s`` is dropped (reason ``ttl``). A group with Δv = current_version - its policy
        version > ``max_staleness`` is dropped (``stale``) or, with ``stale_policy="reweight"``, kept and listed in
        ``weighted``. A group from a version newer than ``current_version`` (generated before a learner restart
        rolled the version back) is dropped (``orphaned``). With ``key_below`` only groups of smaller draw key are
        eligible and the call returns early (with fewer than ``n``) once every key below it is resolved (taken or
        dropped; see the module docstring): a key not reserved yet keeps it waiting, as one still in flight does.
        With ``min_groups`` (partial rollout) it also returns once at least that many groups are taken and no
        other eligible one is ready yet. Blocks until then or until ``timeout``.
        """
        if stale_policy not in ("drop", "reweight"):
            raise QueueError(f"unknown stale_policy {stale_policy!r}", "use 'drop' or 'reweight'")
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        rule = _Staleness(current_version, max_staleness, stale_policy == "reweight")
        with self._cond:  # the drops of a take that timed out are reported by the next one (the ledger lists them)
            out = self._unreported or TakeResult([], {r: 0 for r in DROP_REASONS}, [], [], [], 0.0)
            self._unreported = None
            try:
                while not self._sweep(out, n, rule, key_below):
                    if min_groups is not None and len(out.groups) >= min_groups:
                        break  # partial rollout: the rest of the batch carries over
                    if not self._learner_waiting:
                        self._learner_waiting = True
                        self._cond.notify_all()  # a producer held back by the window may take the awaited batch
                    self._wait(deadline, f"{n} trajectory groups (have {len(out.groups)})", restore=out.groups)
            except QueueError:  # timed out (its groups are back in the queue) or closed
                self._unreported = TakeResult([], out.drops, out.dropped_ids, [], [], 0.0, out.dropped_tokens)
                raise
            finally:
                self._learner_waiting = False
            self._mark_resolved(g.key for g in out.groups)
            self._cond.notify_all()
        out.staleness = [current_version - g.policy_version for g in out.groups]
        out.waited_s = time.monotonic() - started
        return out

    def _sweep(self, out: TakeResult, n: int, rule: "_Staleness", key_below: int | None) -> bool:
        """Move ready groups into ``out`` (oldest draw key first), dropping the expired, orphaned and stale ones;
        whether the take is complete (``n`` groups, or every key below ``key_below`` resolved). Hold the lock."""
        now = self._clock()
        for seq, group in sorted(self._pending.items(), key=lambda kv: (kv[1].key, kv[0])):
            if len(out.groups) >= n:
                break
            if key_below is not None and group.key >= key_below:
                continue
            reason = "ttl" if self.ttl_s is not None and now - group.put_at > self.ttl_s else rule.verdict(group)
            del self._pending[seq]
            if reason is None:
                out.groups.append(group)  # resolved once the take returns: a timed-out take gives it back
                if rule.beyond(group):
                    out.weighted.append(group.group_id)
            else:
                self._mark_resolved((group.key,))
                out.drops[reason] += 1
                self._drops[reason] += 1
                out.dropped_ids.append(group.group_id)
                out.dropped_tokens += group.num_tokens
        return len(out.groups) >= n or (key_below is not None and self._all_resolved_below(key_below, out.groups))

    def _all_resolved_below(self, key_below: int, taking: Sequence[Group] = ()) -> bool:
        """Every draw key below ``key_below`` is resolved, counting the groups this take holds.

        Not merely "none pending or reserved now": a key no producer has
        reserved yet is unresolved too (the learner must wait for it).
        """
        if any(g.key < key_below for g in self._pending.values()) or any(k < key_below for k in self._reserved):
            return False
        done = {k for k in self._keys_above if k < key_below}
        done.update(g.key for g in taking if self._key_floor <= g.key < key_below)
        return len(done) >= key_below - self._key_floor

    def _mark_compacted_resolved(self) -> None:
        """Compacted keys are resolved (compaction stays below every kept cursor); by range, not key by key."""
        for lo, hi in self._compacted.ranges:
            if lo <= self._key_floor:
                self._key_floor = max(self._key_floor, hi + 1)
                self._keys_above = {k for k in self._keys_above if k >= self._key_floor}
                self._mark_resolved(())  # absorb resolved keys the new floor reaches
            else:
                self._mark_resolved(range(lo, hi + 1))

    def _mark_resolved(self, keys: Iterable[int]) -> None:
        self._keys_above.update(k for k in keys if k >= self._key_floor)
        while self._key_floor in self._keys_above:
            self._keys_above.discard(self._key_floor)
            self._key_floor += 1

    def _wait(self, deadline: float | None, what: str, restore: list[Group] | None = None) -> None:
        if self._closed:
            raise QueueError("the trajectory queue was closed while waiting for " + what)
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            for group in restore or ():  # a timed-out take gives back what it had taken
                self._pending[group.seq] = group
            raise QueueTimeout(f"timed out waiting for {what}",
                               "the other side is slow or stopped; check rollout workers and the learner")
        self._cond.wait(remaining if remaining is not None else 1.0)

    # -- introspection -------------------------------------------------------------------

    def stats(self) -> QueueStats:
        with self._lock:
            now = self._clock()
            oldest = min((g.put_at for g in self._pending.values()), default=now)
            size = sum(p.stat().st_size for p in self.segments())
            return QueueStats(depth=len(self._pending), reserved=len(self._reserved), oldest_age_s=now - oldest,
                              puts=self._puts, duplicates=self._duplicates, drops=dict(self._drops), log_bytes=size)

    def reserved_keys(self) -> list[int]:
        with self._lock:
            return sorted(self._reserved)

    def pending_ids(self) -> list[str]:
        with self._lock:
            return [g.group_id for g in self._pending.values()]

    def known(self, group_id: str) -> bool:
        with self._lock:
            return group_id in self._known

    def known_keys(self) -> set[int]:
        """Draw keys of every group ever acknowledged: in the log, or in segments compacted away.

        A resumed producer skips these (it regenerates only keys that were
        drawn but never acknowledged).
        """
        with self._lock:
            return {g.key for g in self._iter_log()} | self._compacted.keys()

    @property
    def compacted_below(self) -> int:
        """Log sequences below this were compacted away (0: nothing compacted)."""
        return self._compacted.below_seq

    def compact(self, below_seq: int) -> list[Path]:
        """Delete whole segments whose records are all below ``below_seq`` (the oldest kept checkpoint's watermark).

        Before a segment goes, the draw keys it held are added to
        ``compacted.json`` (written atomically and fsynced), so ``known_keys``
        still answers for them and a resume never regenerates (and trains
        again) a prompt whose group was compacted away.
        """
        with self._lock:
            self._compacted, removed = compact_segments(self.directory, self.segments(), below_seq, self._compacted)
        return removed

    def close(self) -> None:
        with self._cond:
            self._closed = True
            if self._segment is not None:
                os.close(self._segment)
                self._segment = None
            self._cond.notify_all()
