"""`numwatch tail RUN.jsonl`: follow a run log in the terminal, one Rich line per flush.

The log is read, never locked: the training process keeps appending. A line still being written
(no newline yet) waits for the rest; a log that does not exist yet is waited for; a log that is
truncated or replaced (a new run on the same path) is read again from its start. A line that is
not a record (a crash mid-write cut it short) is skipped with a warning. A compressed (archived)
log does not grow: it is printed with --no-follow.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.markup import escape

from numwatch.cli import count, seconds
from numwatch.events import Event
from numwatch.sinks.console import summary_line
from numwatch.sinks.jsonl import (
    compression,
    is_flush,
    iter_jsonl,
    parse_record,
    warn_unreadable,
)
from numwatch.snapshot import MetricRecord, Snapshot

__all__ = ["follow", "main", "record_to_snapshot"]

_SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "green"}
_log = logging.getLogger("numwatch")


def record_to_snapshot(record: dict[str, Any]) -> tuple[Snapshot, list[Event]]:
    """A JSONL record (as ``parse_record`` returns it) back as the Snapshot and Events the sinks
    saw."""
    metrics = [MetricRecord(m["name"], m["labels"], m["value"]) for m in record["metrics"]]
    snapshot = Snapshot(record["step"], metrics, time=record["time"], rank=record.get("rank", 0))
    fields = set(Event.__dataclass_fields__)
    events = [Event(**{k: v for k, v in e.items() if k in fields}) for e in record["events"]]
    return snapshot, events


def follow(
    path: str | Path,
    *,
    offset: int = 0,
    poll: float = 0.5,
    stop: Callable[[], bool] = lambda: False,
) -> Iterator[dict[str, Any]]:
    """Records of the log at ``path`` from byte ``offset`` (a line start), then as they are
    appended, until ``stop()`` is true at a moment with nothing new to read."""
    path = Path(path)
    while not path.exists():
        if stop():
            return
        time.sleep(poll)
    f = path.open("rb")
    f.seek(offset)
    try:
        inode = os.fstat(f.fileno()).st_ino
        pending = b""
        while True:
            chunk = f.readline()
            if chunk:
                pending += chunk
                if pending.endswith(b"\n"):
                    line, pending = pending, b""
                    if line.strip():
                        record = parse_record(line)
                        if record is None:
                            _log.warning(
                                "numwatch: %s: skipped a line that is not a JSON record "
                                "(at byte %d)",
                                path,
                                f.tell() - len(line),
                            )
                        else:
                            yield record
                continue
            if _replaced(path, inode, f.tell()):
                f.close()
                f = path.open("rb")
                inode, pending = os.fstat(f.fileno()).st_ino, b""
                continue
            if stop():
                return
            time.sleep(poll)
    finally:
        f.close()


def _replaced(path: Path, inode: int, position: int) -> bool:
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    return st.st_ino != inode or st.st_size < position


def print_record(console: Console, record: dict[str, Any], *, events: bool = True) -> None:
    snapshot, found = record_to_snapshot(record)
    if is_flush(record):  # a record of late events: its events are the news
        console.print(summary_line(snapshot, found))
    if events:
        for e in found:
            style = _SEVERITY_STYLE.get(e.severity, "")
            where = " ".join(f"{k}={v}" for k, v in e.labels.items())
            console.print(
                f"  [{style}]{escape(e.kind)}[/] step {e.step} [dim]{escape(e.rule)}[/] "
                f"{escape(where)} — {escape(e.message)}"
            )


def backlog(path: Path, last: int, *, partial: bool = False) -> tuple[list[dict[str, Any]], int]:
    """The complete records of the log now from its ``last``-th flush from the end on (the
    records of late events written at detach or halt come with the flush before them: ``-n 1``
    is the last flush and what followed it), and the byte offset after them (where ``follow``
    goes on: a line still being written is its to read). ``partial``: a last line without its
    newline counts too, if it is a record (nothing will follow it). A plain log is read
    backwards from its end, in growing blocks, until they are found: a long run's log is
    gigabytes. A compressed one (an archive, not followed) is read through, holding the last
    ``last`` flushes' records."""
    if not path.is_file():
        return [], 0
    if compression(path):
        return _from_last_flushes(iter_jsonl(path), last), 0
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        block = 1 << 16
        while True:
            start = max(0, size - block)
            f.seek(start)
            data = f.read(size - start)
            cut = data.rfind(b"\n") + 1  # a line still being written is read by follow()
            if cut == 0 and start > 0:  # not one line start in the block yet
                block *= 4
                continue
            # complete lines; the first one of a block that does not start the file may begin
            # before the block
            lines = data[:cut].split(b"\n")[:-1][1 if start else 0 :]
            unended = parse_record(data[cut:]) if partial and data[cut:].strip() else None
            records = [unended] if unended and last else []
            # skipped: indexes into lines, the last line's (cut by a crash) included
            skipped = [len(lines)] if partial and data[cut:].strip() and not unended else []
            flushes = sum(map(is_flush, records))
            for i in range(len(lines) - 1, -1, -1):
                if flushes >= last:
                    break
                if lines[i].strip():
                    record = parse_record(lines[i])
                    if record is None:
                        skipped.append(i)
                    else:
                        records.append(record)
                        flushes += is_flush(record)
            if flushes >= last or start == 0:
                break
            block *= 4
        if skipped:  # their line numbers: lines[0] is the line after the one cut at start
            first = _newlines_before(f, start) + 2 if start else 1
            warn_unreadable(path, [first + i for i in reversed(skipped)])
    return records[::-1], start + cut


def _from_last_flushes(records: Iterable[dict[str, Any]], last: int) -> list[dict[str, Any]]:
    """``records`` from the ``last``-th flush from the end on, read through holding only those
    (as ``backlog`` finds them backwards: late records before the first flush are kept only
    when the log has fewer flushes than ``last``)."""
    head: list[dict[str, Any]] = []  # late records before the first flush
    groups: deque[list[dict[str, Any]]] = deque(maxlen=max(last, 0))  # a flush + its late ones
    flushes = 0
    for record in records:
        if is_flush(record):
            flushes += 1
            groups.append([record])
        elif not flushes:
            head.append(record)
        elif groups:
            groups[-1].append(record)
    return (head if flushes < last else []) + [r for group in groups for r in group]


def _newlines_before(f: IO[bytes], offset: int) -> int:
    f.seek(0)
    count, left = 0, offset
    while left:
        chunk = f.read(min(left, 1 << 16))
        count += chunk.count(b"\n")
        left -= len(chunk)
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="numwatch tail", description="Follow a numwatch JSONL run log in the terminal."
    )
    parser.add_argument("log", help="the run's JSONL log (sinks.jsonl.path)")
    parser.add_argument(
        "-n", "--lines", type=count, default=10, help="flushes already in the log to show first"
    )
    parser.add_argument(
        "--no-follow", action="store_true", help="print what the log holds and exit"
    )
    parser.add_argument("--interval", type=seconds, default=0.5, help="seconds between polls")
    parser.add_argument("--no-events", action="store_true", help="no line per event")
    args = parser.parse_args(argv)
    console = Console(highlight=False, soft_wrap=True)
    errors = Console(stderr=True, highlight=False, soft_wrap=True)
    path = Path(args.log)
    if path.exists() and not path.is_file():  # a folder: follow() would open it
        errors.print(f"numwatch tail: {escape(str(path))} is not a file")
        return 1
    if args.no_follow and not path.is_file():
        errors.print(f"numwatch tail: no log at {escape(str(path))}")
        return 1
    if not args.no_follow and compression(path):
        errors.print(
            f"numwatch tail: {escape(str(path))} is compressed, an archived log that does not "
            "grow: print it with --no-follow"
        )
        return 1
    try:
        old, offset = backlog(path, args.lines, partial=args.no_follow)
    except (OSError, ValueError) as err:
        errors.print(f"numwatch tail: {escape(str(err))}")
        return 1
    for record in old:
        print_record(console, record, events=not args.no_events)
    if args.no_follow:
        return 0
    if not path.exists():
        console.print(f"[dim]waiting for {escape(str(path))} ...[/]")
    try:
        for record in follow(path, offset=offset, poll=args.interval):
            print_record(console, record, events=not args.no_events)
    except KeyboardInterrupt:
        pass
    return 0
