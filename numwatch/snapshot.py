"""The host-side view of one flush: metric records with labels, read by rules and sinks."""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Mapping
from typing import NamedTuple

__all__ = ["MetricRecord", "Snapshot", "series_key"]


class MetricRecord(NamedTuple):
    """One value of one series; unpacks as ``name, labels, value``. A flush makes thousands."""

    name: str
    labels: Mapping[str, str]
    value: float


class Snapshot:
    """Metrics of one flush; ``step`` is the last training step the flush covers.

    Stored as columns: the monitor keeps its last ``history`` snapshots, and thousands of record
    tuples each (tuple subclasses stay tracked by the garbage collector) made every full
    collection of the training process slower and more frequent (~140 ms each, GPT-2 shaped,
    none without numwatch). Columns are three containers; records are made when iterated.
    """

    def __init__(self, step: int, records: list[MetricRecord], *, time: float, rank: int = 0):
        self.step = step
        self.time = time
        self.rank = rank
        self._names = [r[0] for r in records]
        self._labels = [r[1] for r in records]
        self._values = array("d", [r[2] for r in records])
        self._index_cache: dict[tuple[str, tuple[tuple[str, str], ...]], float] | None = None

    def columns(self) -> tuple[list[str], list[Mapping[str, str]], array]:
        """(names, labels, values) of the records, in order: what bulk readers iterate."""
        return self._names, self._labels, self._values

    @property
    def _index(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        if self._index_cache is None:  # built on the first lookup, not at every flush
            keys = zip(self._names, map(series_key, self._labels), strict=True)
            self._index_cache = dict(zip(keys, self._values, strict=True))
        return self._index_cache

    def __iter__(self) -> Iterator[MetricRecord]:
        return map(MetricRecord._make, zip(self._names, self._labels, self._values, strict=True))

    def __len__(self) -> int:
        return len(self._names)

    def value(self, name: str, **labels: str) -> float:
        """The value of metric ``name`` with exactly these labels; KeyError names what exists."""
        try:
            return self._index[(name, series_key(labels))]
        except KeyError:
            have = [dict(r.labels) for r in self if r.name == name][:5]
            hint = f"series of {name!r} include {have}" if have else f"no metric named {name!r}"
            raise KeyError(f"{name}{labels} not in snapshot of step {self.step}; {hint}") from None

    def get(self, name: str, default: float | None = None, **labels: str) -> float | None:
        return self._index.get((name, series_key(labels)), default)

    def series(self, name: str) -> list[MetricRecord]:
        """Every record of metric ``name`` (all label sets)."""
        return [r for r in self if r.name == name]

    def names(self) -> list[str]:
        return sorted(set(self._names))

    def to_dict(self) -> dict[str, object]:
        return {
            "step": self.step,
            "time": self.time,
            "rank": self.rank,
            "metrics": [{"name": r.name, "labels": dict(r.labels), "value": r.value} for r in self],
        }


def series_key(labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """A label set as a hashable, order-free key: with the metric name it names one series."""
    return tuple(sorted((k, str(v)) for k, v in labels.items()))
