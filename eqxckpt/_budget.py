"""Host memory: the budget a restore may hold beyond its result (`load`'s
``host_memory_budget``), the window of reads in flight that follows from it, the slab a
pass over a whole checkpoint holds at once, and refusing an allocation larger than what
the machine has left."""

import contextlib
import contextvars
from collections.abc import Iterator

from ._errors import CheckpointError

# The host memory a restore may hold beyond its result (`load`'s host_memory_budget).
DEFAULT_HOST_MEMORY_BUDGET = 256 << 20
_HOST_MEMORY_BUDGET: contextvars.ContextVar[int] = contextvars.ContextVar(
    "eqxckpt_host_memory_budget", default=DEFAULT_HOST_MEMORY_BUDGET
)
# The fewest bytes of reads in flight (`read_window`), unless the budget is smaller.
MIN_READ_WINDOW = 16 << 20
# What one step of a pass over a checkpoint holds: `diff` compares large leaves a slab of
# rows at a time and reads small ones in batches of this size; `verify` keeps at least
# this in flight.
SLAB_BYTES = 64 * 1024 * 1024


@contextlib.contextmanager
def limited_host_memory(nbytes: int | None) -> Iterator[None]:
    """Reads inside hold at most ``nbytes`` in flight (None: the default)."""
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1):
        raise CheckpointError(f"host_memory_budget must be a positive number of bytes, got {nbytes!r}.")
    token = _HOST_MEMORY_BUDGET.set(DEFAULT_HOST_MEMORY_BUDGET if nbytes is None else nbytes)
    try:
        yield
    finally:
        _HOST_MEMORY_BUDGET.reset(token)


def host_memory_budget() -> int:
    """The host memory a restore may hold beyond its result, here (`limited_host_memory`)."""
    return _HOST_MEMORY_BUDGET.get()


def read_window(total_bytes: int) -> int:
    """Bytes of reads in flight at once, so that a restore (or a copy) of ``total_bytes``
    peaks near the bytes it moves (what reads hold in flight: an object store's fetched
    chunks, a sharded restore's blocks). A quarter of the total, between `MIN_READ_WINDOW`
    and the host memory budget (256 MiB by default); a budget below `MIN_READ_WINDOW` is
    kept to."""
    return min(host_memory_budget(), max(MIN_READ_WINDOW, total_bytes // 4))


def check_allocation(nbytes: int, what: str) -> None:
    """Refuse, before allocating, to hold more than this machine has available."""
    available = available_memory()
    if available is not None and nbytes > available:
        raise CheckpointError(
            f"{what} needs {nbytes / 2**30:.2f} GiB of host memory, but only {available / 2**30:.2f} GiB is "
            "available. Restore a part (at=, transforms=), restore onto sharded devices, or free memory."
        )


def available_memory() -> int | None:
    """Bytes the kernel says can still be allocated (MemAvailable + SwapFree), if known."""
    try:
        with open("/proc/meminfo", "rb") as f:
            fields = {line.split(b":")[0]: int(line.split()[1]) * 1024 for line in f}
    except (OSError, ValueError, IndexError):
        return None
    return fields.get(b"MemAvailable", 0) + fields.get(b"SwapFree", 0) or None
