"""`collector_paused`: Python's cyclic garbage collector held off while a save or a load
makes its per-leaf objects.

The collector runs after every few hundred new container objects and then walks every
live one; a tree of many leaves makes tens of thousands of records, views and arrays,
none of them in a reference cycle, so each pass finds nothing and costs a walk of the
whole heap (JAX's included). Paused, those passes run once, afterwards, if at all.
"""

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0  # pauses in progress, on every thread
_was_enabled = False


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Hold off cyclic garbage collection inside the block; it resumes (if it was on when
    the first of several overlapping pauses began) once the last one ends.

    ```python
    with collector_paused():
        records = [record_of(...) for ...]
    ```
    """
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
