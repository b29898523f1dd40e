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

    def __init__(
        self, step: int, records: list[MetricRecord], *, time: float, rank: int = 0
    ) -> None:
        self.step = step
        self.time = time
        self.rank = rank
        self._names = [r[0] for r in records]
        self._labels = [r[1] for r in records]
        self._values = array("d", [r[2] for r in records])
        self._index: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        self._positions_cache: dict[str, list[int]] | None = None

    def columns(self) -> tuple[list[str], list[Mapping[str, str]], array]:
        """(names, labels, values) of the records, in order: what bulk readers iterate."""
        return self._names, self._labels, self._values

    def _series_index(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        """Values of metric ``name`` by label key, built on its first lookup (not at every flush,
        and not for the other metrics: keying all ~7,000 records took ~5 ms)."""
        index = self._index.get(name)
        if index is None:
            labels, values = self._labels, self._values
            positions = self._positions.get(name, ())
            index = self._index[name] = {series_key(labels[i]): values[i] for i in positions}
        return index

    @property
    def _positions(self) -> dict[str, list[int]]:
        """Record positions by metric name, built on the first ``series`` call: a console line
        asks for eight metrics, and a walk over all ~7,000 records each cost ~2 ms."""
        if self._positions_cache is None:
            positions: dict[str, list[int]] = {}
            for i, name in enumerate(self._names):
                positions.setdefault(name, []).append(i)
            self._positions_cache = positions
        return self._positions_cache

    def __iter__(self) -> Iterator[MetricRecord]:
        return map(MetricRecord._make, zip(self._names, self._labels, self._values, strict=True))

    def __len__(self) -> int:
        return len(self._names)

    def value(self, name: str, **labels: str) -> float:
        """The value of metric ``name`` with exactly these labels; KeyError names what exists."""
        try:
            return self._series_index(name)[series_key(labels)]
        except KeyError:
            have = [dict(r.labels) for r in self.series(name)[:5]]
            hint = f"series of {name!r} include {have}" if have else f"no metric named {name!r}"
            raise KeyError(f"{name}{labels} not in snapshot of step {self.step}; {hint}") from None

    def get(self, name: str, default: float | None = None, **labels: str) -> float | None:
        return self._series_index(name).get(series_key(labels), default)

    def series(self, name: str) -> list[MetricRecord]:
        """Every record of metric ``name`` (all label sets), in order."""
        labels, values = self._labels, self._values
        return [MetricRecord(name, labels[i], values[i]) for i in self._positions.get(name, ())]

    def names(self) -> list[str]:
        return sorted(self._positions)

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
