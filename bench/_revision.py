"""Import a module of this package as it was at an earlier git revision, for same-process A/Bs
(ab_flash_gluon.py, ab_attention_stats.py): the old file is written next to the current one and
imported as its sibling, so its relative imports resolve to this tree's helpers."""

from __future__ import annotations

import importlib
import subprocess
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def import_at_revision(rev: str, current: ModuleType, tag: str) -> ModuleType:
    """``current`` (a module of numwatch.kernels) as of git revision ``rev``, imported as
    ``<package>._ab_<tag>_old``; the file it was loaded from is removed at once."""
    path = Path(current.__file__)
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:{path.relative_to(ROOT).as_posix()}"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    stem = f"_ab_{tag}_old"
    old_path = path.with_name(f"{stem}.py")
    old_path.write_text(source)
    try:
        name = f"{current.__package__}.{stem}"
        importlib.invalidate_caches()
        return importlib.reload(importlib.import_module(name))
    finally:
        old_path.unlink()
