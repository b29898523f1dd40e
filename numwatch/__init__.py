"""numwatch: a training-time numerical health monitor for PyTorch.

monitor = numwatch.Monitor(model).attach(optimizer)
...  # train as usual
monitor.detach()
"""

from numwatch.config import MonitorConfig
from numwatch.errors import NumwatchConfigError, NumwatchError
from numwatch.events import Event
from numwatch.monitor import Monitor
from numwatch.snapshot import MetricRecord, Snapshot

__version__ = "0.1.0"

__all__ = [
    "Event",
    "MetricRecord",
    "Monitor",
    "MonitorConfig",
    "NumwatchConfigError",
    "NumwatchError",
    "Snapshot",
    "__version__",
]
