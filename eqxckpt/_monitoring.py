"""What eqxckpt reports through `jax.monitoring`, where goodput and profiling tools (and
any listener a job registers) already read JAX's and Orbax's events: each save's and
each load's durations and bytes, under the one prefix ``/eqxckpt/``."""

import time

import jax.monitoring

PREFIX = "/eqxckpt"
# Seconds the caller of `save` was blocked (the snapshot only, for ``blocking=False``).
SAVE_BLOCKED = f"{PREFIX}/save/blocked_duration_secs"
# Seconds from the call of `save` to its commit (background work included).
SAVE_COMMITTED = f"{PREFIX}/save/commit_duration_secs"
# Bytes of arrays this process wrote (leaves shared from a base are not written).
SAVE_BYTES = f"{PREFIX}/save/bytes_written"
# Seconds a `load` took, and the bytes of the stored leaves it restored.
LOAD_DURATION = f"{PREFIX}/load/duration_secs"
LOAD_BYTES = f"{PREFIX}/load/bytes_read"
EVENTS = (SAVE_BLOCKED, SAVE_COMMITTED, SAVE_BYTES, LOAD_DURATION, LOAD_BYTES)


def record_duration(event: str, since: float) -> None:
    """Report the seconds from ``since`` (a `time.perf_counter` reading) to now as ``event``."""
    jax.monitoring.record_event_duration_secs(event, time.perf_counter() - since)


def record_bytes(event: str, nbytes: int) -> None:
    """Report ``nbytes`` as ``event``."""
    jax.monitoring.record_scalar(event, nbytes)
