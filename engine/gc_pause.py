"""Building long-lived objects with Python's cyclic GC paused."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused(freeze: bool = False) -> Iterator[None]:
    """Pause the cyclic GC for the block (imports, a parsed config); then, with `freeze`, move every object tracked so
    far out of its later passes (a rank's own process, whose imports live as long as it; never in a user's process,
    where it would keep garbage waiting for collection alive).

    torch and transformers create millions of long-lived objects; collecting them over and over while two ranks
    start on two cores cost about a second before the first health check (rank 0's transformers config: 0.24 s).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if enabled:
            gc.enable()
