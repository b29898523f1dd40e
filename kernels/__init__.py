"""Triton kernels of numwatch, each beside the pure-torch reference that is its oracle and CPU path.

This folder is installed as ``numwatch.kernels``. It must never be imported as a bare top-level
``kernels`` module (for example from a shell whose working directory is the repository root):
that name belongs to an unrelated PyPI package that libraries such as transformers look for.
"""

if __name__ != "numwatch.kernels":
    raise ImportError(
        f"numwatch's kernels folder was imported as {__name__!r}; it is only importable as "
        "'numwatch.kernels' (install numwatch with `pip install -e .` and import numwatch.kernels)"
    )
