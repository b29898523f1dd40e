"""Packaging contract: the public API is frozen and kernels/ never shadows PyPI's `kernels`."""

import subprocess
import sys
from pathlib import Path

import numwatch

ROOT = Path(__file__).resolve().parents[1]


def test_public_api_is_frozen():
    assert sorted(numwatch.__all__) == [
        "Event",
        "MetricRecord",
        "Monitor",
        "MonitorConfig",
        "NumwatchConfigError",
        "NumwatchError",
        "Snapshot",
        "__version__",
    ]


def test_kernels_importable_only_as_numwatch_kernels():
    import numwatch.kernels

    assert Path(numwatch.kernels.__file__).parent == ROOT / "kernels"


def _import_kernels(cwd: Path) -> subprocess.CompletedProcess:
    code = "import kernels"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True)


def test_bare_kernels_not_importable_from_repo_root():
    result = _import_kernels(ROOT)
    assert result.returncode != 0
    assert "only importable as 'numwatch.kernels'" in result.stderr


def test_bare_kernels_not_installed(tmp_path):
    result = _import_kernels(tmp_path)
    assert result.returncode != 0
    assert "No module named 'kernels'" in result.stderr
