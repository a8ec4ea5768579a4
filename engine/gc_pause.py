"""Building long-lived objects with Python's cyclic GC paused, then frozen out of its later passes."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def long_lived_imports() -> Iterator[None]:
    """Pause the cyclic GC for the block (imports, a parsed config), then freeze what it built.

    torch and transformers create millions of long-lived objects; collecting them over and over while two ranks
    start on two cores cost about a second before the first health check (rank 0's transformers config: 0.24 s).
    """
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()
