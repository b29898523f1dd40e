"""Packaging contract: the public API is frozen and kernels/ never shadows PyPI's `kernels`."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def _python(code: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, env=environ
    )


def test_bare_kernels_from_repo_root_exposes_no_numwatch_code():
    code = (
        "import kernels; print(kernels.__file__, kernels.__path__)\n"
        "try:\n    import kernels.tensor_stats\nexcept ModuleNotFoundError:\n    print('hidden')"
    )
    result = _python(code, ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["None", "[]", "hidden"]


def test_bare_kernels_from_repo_root_hands_over_the_pypi_package(tmp_path):
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("__version__ = '0.4.2'\n")
    code = "import kernels; print(kernels.__version__, kernels.__file__)"
    result = _python(code, ROOT, PYTHONPATH=str(tmp_path / "site"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0.4.2", str(fake / "__init__.py")]


def test_transformers_imports_from_repo_root():
    pytest.importorskip("transformers")
    code = (
        "from transformers.utils.import_utils import is_kernels_available\n"
        "from transformers import AttentionInterface\n"
        "print(is_kernels_available())"
    )
    result = _python(code, ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_bare_kernels_not_installed(tmp_path):
    result = _python("import kernels", tmp_path)
    assert result.returncode != 0
    assert "No module named 'kernels'" in result.stderr
