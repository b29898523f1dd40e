"""The JSONL run log: the embedded default sink that needs no server.

One JSON object per flush and line (schema in README, 'JSONL schema'), flushed to the OS at once,
so a crash loses at most the record being written. Non-finite numbers, which JSON cannot hold,
are written as the strings "nan", "inf" and "-inf".
"""

from __future__ import annotations

import errno
import gzip
import json
import logging
import lzma
import math
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from itertools import compress
from pathlib import Path
from typing import IO, Any

from numwatch.errors import LogInUse, NumwatchConfigError

try:
    import fcntl
except ImportError:  # not POSIX: the in-process check only
    fcntl = None  # type: ignore[assignment]
from numwatch.events import Event
from numwatch.selection import matches
from numwatch.snapshot import Snapshot

__all__ = [
    "SCHEMA_VERSION",
    "JsonlSink",
    "LogInUse",
    "RunBoundaries",
    "compression",
    "is_flush",
    "iter_jsonl",
    "iter_log_lines",
    "json_safe",
    "open_log",
    "parse_record",
    "read_jsonl",
    "run_starts",
    "warn_unreadable",
    "writing",
]

SCHEMA_VERSION = 1

_log = logging.getLogger("numwatch")


def json_safe(value: Any) -> Any:
    """``value`` with its non-finite floats spelled as this log spells them ("nan", "inf"):
    strict JSON has no NaN or Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


# json.dumps's spelling of the non-finite floats -> the strings this log writes instead.
_NONFINITE = {"NaN": '"nan"', "Infinity": '"inf"', "-Infinity": '"-inf"'}


def _numbers(values: list[float]) -> list[str]:  # floats: json.dumps would write ints bare
    """JSON texts of many floats at once, NaN/Inf as the log's strings: the C encoder writes
    each finite value as repr(float) does."""
    texts = json.dumps(values).strip("[]").split(", ") if values else []
    return [_NONFINITE.get(t, t) for t in texts]


# Logs open for writing in this process (resolved paths), one writer each.
_WRITING: set[str] = set()


def writing(path: str | Path) -> bool:
    """Whether an attached monitor of this process writes its log at ``path``."""
    return str(Path(path).resolve()) in _WRITING


class JsonlSink:
    name = "jsonl"

    def __init__(
        self,
        path: str | Path,
        run_name: str,
        every: int = 1,
        exclude: Sequence[str] = (),
        monitor: str = "",
    ) -> None:
        """``monitor``: the writing Monitor's id, in every record (replay starts its rules'
        history over where it changes, as a resumed run's monitor did)."""
        if every < 1:
            raise ValueError(f"JsonlSink every must be >= 1, got {every}")
        self.path = Path(path)
        if self.path.suffix in (".gz", ".xz"):
            raise NumwatchConfigError(
                f"sinks.jsonl.path {str(path)!r}: numwatch writes a plain JSONL log (appended "
                "every flush, readable while the run goes on); drop the suffix and compress the "
                "finished log (gzip, or bench/archive_log.py): the readers open .gz and .xz"
            )
        self.run_name = run_name
        self.monitor = monitor
        self.every = every
        self.exclude = tuple(exclude)
        self._flushes = 0
        self._held: Snapshot | None = None  # the last skipped flush: written at close
        self._rank = 0  # the last flush's, for records of late events
        self._last_step: int | None = None  # the last written flush's step, likewise
        self._cut = False  # a failed write may have left a partial line
        self._kept: dict[str, bool] = {}  # metric name -> written (the globs tested once)
        self._key = str(self.path.resolve())
        if self._key in _WRITING:
            raise LogInUse(
                f"sinks.jsonl.path {str(path)!r} is the log of another attached monitor in this "
                "process: two runs would interleave their records in one file (give each "
                "monitor its own run_name or path)"
            )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        except OSError as err:
            raise NumwatchConfigError(
                f"sinks.jsonl.path {str(path)!r} cannot be written: {_unwritable(self.path, err)}; "
                "set a file path in a folder this process can write"
            ) from None
        _lock(self._file, path)
        _end_partial_line(self.path)
        _WRITING.add(self._key)
        _OPEN_LOGS.add(self._file)
        # also if dropped unclosed (a monitor left attached after a halt): the path is free
        # again and the file closed, not left to the garbage collector's ResourceWarning
        self._release = weakref.finalize(self, _release, self._key, self._file)
        # '{"name": ..., "labels": {...}, "value": ' per series: the same every flush, so a flush
        # encodes only its numbers (thousands of series per flush on a large model).
        self._prefixes: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}
        # The series of the last written flush and its metrics text with a %r per value: while
        # the series stay the same (most flushes), one C-level format writes all the numbers.
        self._layout: tuple[list[str], list[dict[str, str]], str] | None = None

    def _prefix(self, name: str, labels: Mapping[str, str]) -> str:
        key = (name, tuple(labels.items()))
        text = self._prefixes.get(key)
        if text is None:
            head = json.dumps({"name": name, "labels": dict(labels)})[:-1]
            text = self._prefixes[key] = f'{head}, "value": '
            if len(self._prefixes) > 1_000_000:
                self._prefixes.clear()
        return text

    def _keeps(self, name: str) -> bool:
        kept = self._kept.get(name)
        if kept is None:
            kept = self._kept[name] = matches(name, ("*",), self.exclude)
        return kept

    def emit(self, snapshot: Snapshot, events: Sequence[Event]) -> None:
        """Write the flush's record: every ``every``-th flush, any flush with events, and (at
        close) the last one, so the log always ends with the run's final state."""
        self._flushes += 1
        self._rank = snapshot.rank
        held, self._held = self._held, None
        if held is not None and held.step == snapshot.step:
            # a second flush of one step (detach's, after a final evaluation) does not
            # supersede that step's training record: it is written too
            self._write(held, [])
        if self._flushes % self.every and not events:
            self._held = snapshot
            return
        self._write(snapshot, events)

    def _write(self, snapshot: Snapshot, events: Sequence[Event]) -> None:
        self._last_step = snapshot.step
        head = {
            "schema": SCHEMA_VERSION,
            "run": self.run_name,
            "step": snapshot.step,
            "time": snapshot.time,
            "rank": snapshot.rank,
            "monitor": self.monitor,
        }
        names, labels, values = snapshot.columns()
        values = values.tolist()
        if self.exclude:
            keep = list(map(self._keeps, names))
            if not all(keep):
                names, labels = list(compress(names, keep)), list(compress(labels, keep))
                values = list(compress(values, keep))
        metrics = self._metrics(names, labels, values)
        tail = json.dumps(json_safe([e.to_dict() for e in events]), allow_nan=False)
        self._append(f'{json.dumps(head)[:-1]}, "metrics": [{metrics}], "events": {tail}}}\n')

    def _append(self, line: str) -> None:
        """Write one record straight to the file, unbuffered: a write that fails part-way (a
        full disk, a quota) leaves a cut line, which the next record, written once there is
        space again, starts by ending, as opening the log ends a crash's."""
        data = memoryview(("\n" + line if self._cut else line).encode())
        self._cut = True
        while data:
            data = data[os.write(self._file.fileno(), data) :]
        self._cut = False

    def _metrics(
        self, names: list[str], labels: list[Mapping[str, str]], values: list[float]
    ) -> str:
        """The metrics array's text (without brackets)."""
        # NaN and Inf make the sum non-finite (an overflow only costs this slower path)
        if not math.isfinite(sum(values)):
            pairs = zip(map(self._prefix, names, labels), _numbers(values), strict=True)
            return ", ".join([p + n + "}" for p, n in pairs])
        layout = self._layout
        if layout is None or layout[0] != names or layout[1] != labels:
            prefixes = map(self._prefix, names, labels)
            template = ", ".join([p.replace("%", "%%") + "%r}" for p in prefixes])
            # copies: a label dict changed in place later must not pass for the old series
            layout = self._layout = (list(names), [dict(x) for x in labels], template)
        return layout[2] % tuple(values)  # repr(float) is json's spelling of a finite float

    def emit_events(self, events: Sequence[Event]) -> None:
        """Events raised after the last flush (what its actions did), at detach, in a record of
        their own with no metrics. (That flush had the rules' events: it was written, not held.)"""
        head = {
            "schema": SCHEMA_VERSION,
            "run": self.run_name,
            # never before the last flush's step: readers would take it for a new run
            "step": max([e.step for e in events] + [self._last_step or 0]),
            "time": max(e.time for e in events),
            "rank": self._rank,
            "monitor": self.monitor,
        }
        tail = json.dumps(json_safe([e.to_dict() for e in events]), allow_nan=False)
        self._append(f'{json.dumps(head)[:-1]}, "metrics": [], "events": {tail}}}\n')

    def close(self) -> None:
        if self._held is not None:
            self._write(self._held, [])
            self._held = None
        self._file.close()
        self._release()


def _release(key: str, file: IO[str]) -> None:
    _WRITING.discard(key)
    _OPEN_LOGS.discard(file)
    file.close()


# The open logs, closed in a forked child (a DataLoader worker): a flock belongs to the open
# file, which the child shares, so the log would stay locked after detach while it lives.
_OPEN_LOGS: weakref.WeakSet[IO[str]] = weakref.WeakSet()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: [f.close() for f in list(_OPEN_LOGS)])
_LOCK_UNSUPPORTED: list[str] = []  # said once per process


def _unwritable(path: Path, err: OSError) -> str:
    """Why the log cannot be opened, in words: the OSError alone did not name the setting, and
    said 'File exists' for a parent that is a file."""
    if path.is_dir():
        return "it is a folder, not a file"
    for parent in reversed(path.parents):
        if parent.exists() and not parent.is_dir():
            return f"{str(parent)!r} is a file, not a folder"
    if not path.parent.is_dir():
        return f"its folder {str(path.parent)!r} cannot be created ({err.strerror})"
    return f"{err.strerror} ({str(err.filename)!r})"


def _lock(file: IO[str], path: str | Path) -> None:
    """Lock the log against a writer in another process (a sweep started in one second). Where
    the filesystem has no flock (Lustre with noflock, some FUSE or NFS mounts), the log is
    written unlocked, said once."""
    if fcntl is None:
        return
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            file.close()
            raise LogInUse(
                f"sinks.jsonl.path {str(path)!r} is the log of a monitor attached in another "
                "process: two runs would interleave their records in one file (give each run "
                "its own run_name or path)"
            ) from None
        if not _LOCK_UNSUPPORTED:
            _LOCK_UNSUPPORTED.append(str(path))
            _log.warning(
                "numwatch: %s: the filesystem cannot lock the log (%s); it is written unlocked, "
                "so two processes on one path would interleave their records",
                path,
                err.strerror or err,
            )


def _end_partial_line(path: Path) -> None:
    """End the last line of a log that a crash left partial: a run appending to the same path
    would otherwise glue its first record onto it, and lose that record with the partial one."""
    if not path.is_file():
        return
    with path.open("r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                f.write(b"\n")


_MAGIC = {b"\x1f\x8b": ".gz", b"\xfd7zXZ\x00": ".xz"}


def compression(path: str | Path) -> str | None:
    """``.gz`` or ``.xz`` for a compressed log, else None: by its name's suffix, as archived logs
    are named, or else by its first bytes (``gzip -c run.jsonl > run.jsonl.1`` keeps a plain
    name). A name that says compressed is taken at its word: the readers then refuse a plain
    file under it in one line."""
    path = Path(path)
    if path.suffix in (".gz", ".xz"):
        return path.suffix
    try:
        with path.open("rb") as f:
            head = f.read(6)
    except OSError:  # missing, a folder, unreadable: the caller's open says which
        return None
    return next((kind for magic, kind in _MAGIC.items() if head.startswith(magic)), None)


def open_log(path: str | Path, mode: str = "rt") -> IO[Any]:
    """A run log for reading (``mode`` "rt" or "rb"), decompressed where ``compression`` says
    it is compressed."""
    opener = {".gz": gzip.open, ".xz": lzma.open}.get(compression(path) or "", open)
    return opener(path, mode, encoding=None if "b" in mode else "utf-8")


def _floats(item: dict[str, Any], *keys: str) -> None:
    for key in keys:
        if isinstance(item.get(key), str):
            item[key] = float(item[key])  # "nan", "inf", "-inf"


def parse_record(line: str | bytes) -> dict[str, Any] | None:
    """One line of a log as a record, non-finite strings back as floats; None for a line that
    is not one (cut short by a crash mid-write), which readers skip: the rest is still the run."""
    try:
        record = json.loads(line)
        if not isinstance(record, dict) or not {"step", "metrics", "events"} <= record.keys():
            return None
        for m in record["metrics"]:
            _floats(m, "value")
        for e in record["events"]:
            _floats(e, "value", "threshold")
    except (ValueError, TypeError, AttributeError):  # bad JSON or UTF-8; a field of wrong type
        return None
    return record


def warn_unreadable(path: str | Path, lines: Sequence[int]) -> None:
    """One warning for the lines (1-based) of ``path`` that were skipped as not records."""
    if lines:
        shown = ", ".join(map(str, lines[:10])) + (", ..." if len(lines) > 10 else "")
        _log.warning(
            "numwatch: %s: skipped %d line(s) that are not JSON records (a crash mid-write "
            "leaves one): line %s",
            path,
            len(lines),
            shown,
        )


def iter_log_lines(path: str | Path) -> Iterator[bytes]:
    """The lines of a run log as bytes (``open_log``); of a compressed log cut short, those up to
    the cut, with a warning."""
    started = False
    with open_log(path, "rb") as f:
        try:
            for line in f:
                started = True
                yield line
        except (EOFError, gzip.BadGzipFile, lzma.LZMAError) as err:
            if not started and not isinstance(err, EOFError):
                raise ValueError(f"{path}: not a compressed log, though its name says so") from None
            _log.warning("numwatch: %s: the compressed log ends early; read up to there", path)


def iter_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of a run log one by one (``iter_log_lines``, ``parse_record``), for readers of
    long logs that keep less than every record; lines that are not records (bad UTF-8 among
    them) are skipped with one warning at the end (``warn_unreadable``)."""
    skipped = []
    for number, line in enumerate(iter_log_lines(path), 1):
        if line.strip():
            record = parse_record(line)
            if record is None:
                skipped.append(number)
            else:
                yield record
    warn_unreadable(path, skipped)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a run log (``iter_jsonl``)."""
    return list(iter_jsonl(path))


def is_flush(record: dict[str, Any]) -> bool:
    """Whether a record is a flush's, not the record of late events ``emit_events`` writes at
    detach (no metrics: what the last flush's actions did)."""
    return bool(record["metrics"])


class RunBoundaries:
    """Where each run begins in a log's records, read one by one (a path reused by a later run
    holds several): where the run name changes, or a flush's step goes back from the previous
    flush's. An equal step stays in the run (a manual flush with no new step), and so does a
    record without metrics (detach's late events): its step is its events', and a NaN's origin
    step precedes the flush that reported it."""

    def __init__(self) -> None:
        self._last: tuple[Any, int] | None = None  # (run, step) of the run's last flush

    def starts(self, record: dict[str, Any]) -> bool:
        run, step = record.get("run"), record["step"]
        last = self._last
        new = last is None or run != last[0] or (is_flush(record) and step < last[1])
        if new or is_flush(record):
            self._last = (run, step)
        return new


def run_starts(records: list[dict[str, Any]]) -> list[int]:
    """Where each run begins in the records of a log (``RunBoundaries``)."""
    boundaries = RunBoundaries()
    return [i for i, r in enumerate(records) if boundaries.starts(r)]
