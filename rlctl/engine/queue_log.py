"""The trajectory queue's write-ahead log: record framing, segment scanning, groups as JSON, compaction notes.

What this is: the on-disk format of rlctl.engine.queue. Append-only segment
files ``seg-<first seq>.log``, each a sequence of records::

    b"RLQ1" | u32 payload length | u32 crc32(payload) | payload (JSON of one group)

``scan_segment`` reads one segment back: a record that does not fit before end
of file, or whose CRC fails and that is the last thing in the newest segment,
is a torn tail (it was never acknowledged, so recovery truncates it); anything
else that fails to parse is corruption of acknowledged data and raises
``QueueCorruptError`` naming the file and byte offset. ``Group`` is one
prompt's G trajectories as the log holds them; ``Compacted`` records what
compaction removed (``compacted.json``).

What this is not: the queue's state, admission or consumption (rlctl.engine.queue).
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

from rlctl.contracts.errors import RlctlError
from rlctl.contracts.types import SamplingConfig, TerminalReason, Trajectory, Turn, Writer
from rlctl.storage.durable import fsync_path

MAGIC = b"RLQ1"
_HEADER = struct.Struct("<4sII")  # magic, payload length, crc32
MAX_RECORD_BYTES = 256 << 20  # a length above this is not a record: corruption, never a 4 GiB allocation


class QueueError(RlctlError):
    """The trajectory queue cannot be used as asked."""


class QueueCorruptError(QueueError):
    """An acknowledged record of the write-ahead log is damaged."""


class QueueFull(QueueError):
    """A non-blocking put or reserve found the queue at capacity."""


class QueueTimeout(QueueError):
    """A blocking call waited longer than its timeout."""


# -- trajectories as JSON ---------------------------------------------------------


def trajectory_to_dict(t: Trajectory) -> dict[str, Any]:
    body = asdict(t)
    body["terminal_reason"] = t.terminal_reason.value
    body["reward_components"] = dict(t.reward_components)
    body["turns"] = [{**asdict(turn), "writer": turn.writer.value} for turn in t.turns]
    return body


def trajectory_from_dict(body: Mapping[str, Any]) -> Trajectory:
    values = dict(body)
    values["sampling_config"] = SamplingConfig(**{**values["sampling_config"],
                                                  "stop": tuple(values["sampling_config"].get("stop", ()))})
    values["terminal_reason"] = TerminalReason(values["terminal_reason"])
    for key in ("prompt_tokens", "response_tokens", "action_mask", "behavior_logprobs"):
        values[key] = tuple(values[key])
    values["turns"] = tuple(Turn(**{**turn, "writer": Writer(turn["writer"])}) for turn in values.get("turns", ()))
    t = Trajectory(**values)
    if not t.verify():
        raise ValueError(f"trajectory {t.id!r} does not match its checksum")
    return t


# -- entries ------------------------------------------------------------------------


@dataclass
class Group:
    """One prompt's G trajectories as the queue holds them.

    ``key`` is the producer's draw index (prompt order); ``seq`` the log
    position (arrival order). ``policy_version`` is the oldest version among
    the samples, and of an episode the oldest of its policy turns: staleness
    is judged by the stalest segment of the group, never by a newer turn.
    """

    group_id: str
    key: int
    trajectories: tuple[Trajectory, ...]
    put_at: float
    seq: int = -1

    @property
    def policy_version(self) -> int:
        return min(min((t.policy_version, *t.policy_versions)) for t in self.trajectories)

    @property
    def num_tokens(self) -> int:
        return sum(t.num_policy_tokens for t in self.trajectories)  # generated: an episode's policy tokens

    def to_payload(self) -> bytes:
        body = {"group": self.group_id, "key": self.key, "put_at": self.put_at,
                "trajectories": [trajectory_to_dict(t) for t in self.trajectories]}
        return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_payload(cls, payload: bytes, seq: int) -> "Group":
        body = json.loads(payload)
        return cls(group_id=body["group"], key=int(body["key"]), put_at=float(body["put_at"]), seq=seq,
                   trajectories=tuple(trajectory_from_dict(t) for t in body["trajectories"]))


# -- the log ------------------------------------------------------------------------


def encode_record(payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)) + payload


def scan_segment(path: Path, *, last: bool) -> tuple[list[tuple[int, bytes]], int | None]:
    """Records of one segment as ``(offset, payload)``; plus the torn-tail offset to truncate at, if any.

    Raises QueueCorruptError for damage that is not a torn tail of the newest segment.
    """
    data = path.read_bytes()
    out: list[tuple[int, bytes]] = []
    pos = 0
    while pos < len(data):
        problem = None
        end = len(data)
        if len(data) - pos < _HEADER.size:
            problem = "an incomplete record header"
        else:
            magic, length, crc = _HEADER.unpack_from(data, pos)
            if magic != MAGIC:
                problem = f"bad record magic {magic!r}"
            elif length > MAX_RECORD_BYTES:
                problem = f"an impossible record length {length}"
            else:
                end = pos + _HEADER.size + length
                if end > len(data):
                    problem = "a record cut short by end of file"
                    end = len(data)
                elif zlib.crc32(data[pos + _HEADER.size:end]) != crc:
                    problem = "a record whose CRC32 does not match"
        if problem is None:
            out.append((pos, data[pos + _HEADER.size:end]))
            pos = end
            continue
        framed = problem.startswith(("a record cut", "a record whose", "an incomplete"))
        if not framed and not any(data[pos:]):
            framed = True  # zeros to the end: blocks allocated but never written (power loss mid-append)
        if last and framed and end >= len(data):
            return out, pos  # torn tail: the last append never completed, so it was never acknowledged
        raise QueueCorruptError(
            f"trajectory log {path} has {problem} at byte offset {pos} followed by more data",
            "an acknowledged record is damaged (disk fault or outside edit); restore the run directory from a "
            "backup, or move the log away to start the queue empty (buffered trajectories are then regenerated)")
    return out, None


@dataclass(frozen=True)
class Compacted:
    """What compaction removed from the log: everything below ``below_seq``; ``ranges`` are its draw keys.

    Kept in ``compacted.json`` beside the segments. Keys are stored as
    inclusive ``[first, last]`` ranges: draw keys are nearly contiguous, so
    the file stays a few lines however long the run.
    """

    below_seq: int = 0
    ranges: tuple[tuple[int, int], ...] = ()

    FILE = "compacted.json"

    def keys(self) -> set[int]:
        return {k for lo, hi in self.ranges for k in range(lo, hi + 1)}

    def extended(self, keys: Iterable[int], below_seq: int) -> "Compacted":
        merged: list[list[int]] = []
        for key in sorted(self.keys() | set(keys)):
            if merged and key == merged[-1][1] + 1:
                merged[-1][1] = key
            else:
                merged.append([key, key])
        return Compacted(below_seq=max(self.below_seq, below_seq), ranges=tuple((a, b) for a, b in merged))

    def save(self, directory: Path) -> None:
        tmp = directory / (self.FILE + ".tmp")
        tmp.write_text(json.dumps({"below_seq": self.below_seq, "key_ranges": [list(r) for r in self.ranges]}))
        fsync_path(tmp)
        os.replace(tmp, directory / self.FILE)
        fsync_path(directory)

    @classmethod
    def load(cls, directory: Path) -> "Compacted":
        path = directory / cls.FILE
        if not path.is_file():
            return cls()
        try:
            body = json.loads(path.read_text())
            return cls(below_seq=int(body["below_seq"]),
                       ranges=tuple((int(a), int(b)) for a, b in body["key_ranges"]))
        except (ValueError, KeyError, TypeError) as err:
            raise QueueCorruptError(f"{path} is unreadable ({err})",
                                    "restore the run directory from a backup") from None


def segment_start(path: Path) -> int:
    """The sequence number of a segment's first record (its name: ``seg-<first seq>.log``)."""
    return int(path.stem.split("-")[1])


def read_groups(path: Path, records: list[tuple[int, bytes]], first_seq: int) -> Iterator[Group]:
    """The groups of one scanned segment, numbered from ``first_seq``; an unreadable record is corruption."""
    for i, (offset, payload) in enumerate(records):
        try:
            yield Group.from_payload(payload, first_seq + i)
        except (ValueError, KeyError, TypeError) as err:
            raise QueueCorruptError(f"trajectory log {path} holds an unreadable record at byte offset {offset} "
                                    f"({err})", "restore the run directory from a backup") from None


def truncate_tail(path: Path, torn: int) -> int:
    """Cut a torn last record off the newest segment (durably); the bytes removed."""
    cut = path.stat().st_size - torn
    with path.open("r+b") as handle:
        handle.truncate(torn)
        handle.flush()
        os.fsync(handle.fileno())
    return cut


def compact_segments(directory: Path, segments: list[Path], below_seq: int,
                     compacted: Compacted) -> tuple[Compacted, list[Path]]:
    """Delete whole segments whose records are all below ``below_seq``; the extended compaction note and the paths.

    The note (with the draw keys the doomed segments held) is written
    atomically and fsynced before any segment is deleted, so the queue still
    knows those keys after a crash at any point.
    """
    doomed = [path for path, following in zip(segments, segments[1:]) if segment_start(following) <= below_seq]
    if not doomed:
        return compacted, []
    keys = {int(json.loads(payload)["key"]) for path in doomed for _, payload in scan_segment(path, last=False)[0]}
    compacted = compacted.extended(keys, segment_start(segments[len(doomed)]))
    compacted.save(directory)  # durable before any segment is deleted
    for path in doomed:
        path.unlink()
    fsync_path(directory)
    return compacted, doomed
