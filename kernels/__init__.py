"""Triton kernels of numwatch, each beside the pure-torch reference that is its oracle and CPU path.

This folder is installed as ``numwatch.kernels``. Python started in the repository root (``python
-c``, ``python -m``, a notebook) also finds it as a bare top-level ``kernels``, a name that belongs
to an unrelated PyPI package which transformers probes for at import time. Imported under that
name, this file never exposes numwatch's code: it hands over PyPI's ``kernels`` when that is
installed elsewhere on ``sys.path``, and otherwise leaves an empty module with no ``__file__``
and no submodules, which transformers (and anyone) recognises as "not installed".
"""

import sys

if __name__ != "numwatch.kernels":
    import importlib.machinery
    import importlib.util
    import os

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec(__name__, _elsewhere)
    if _spec is not None and _spec.loader is not None:
        _real = importlib.util.module_from_spec(_spec)
        sys.modules[__name__] = _real  # the import statement returns this module
        _spec.loader.exec_module(_real)
    else:
        # numwatch's kernel modules are not reachable as kernels.*, and no __file__ is what a
        # namespace package that shadows nothing looks like.
        __path__ = []
        __file__ = None
else:
    # The stabilized kernel is numwatch.kernels.flash_attention(q, k, v, ...), as its issue
    # specifies; its module stays importable with `from numwatch.kernels.flash_attention import`.
    from numwatch.kernels.flash_attention import (
        flash_attention,
        flash_attention_fallbacks,
        flash_attention_reference,
    )

    __all__ = ["flash_attention", "flash_attention_fallbacks", "flash_attention_reference"]
