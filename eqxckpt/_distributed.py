"""Several JAX processes writing one checkpoint: phases separated by barriers.

The barriers use the coordination service that `jax.distributed.initialize`
starts (a key-value store plus barriers), not a device collective, so they can
run on a background thread while the caller's thread keeps training.
"""

import itertools
import json
import os
from collections.abc import Callable

from . import _errors
from ._errors import CheckpointError

# How long a process waits for the others at each phase of a save. A crashed
# process makes the others fail after this long instead of hanging forever.
BARRIER_TIMEOUT_S = float(os.environ.get("EQXCKPT_BARRIER_TIMEOUT_S", "600"))

# Every process calls save() (and load()) in the same order, so these counts name the
# same save (restore) on every process without any communication.
_counters = {what: itertools.count() for what in ("save", "restore", "local", "resume", "publish")}


def process_index() -> int:
    import jax

    return jax.process_index()


def process_count() -> int:
    import jax

    return jax.process_count()


def is_multiprocess() -> bool:
    import jax

    return jax.process_count() > 1


def coordination_client():
    """The client of the coordination service `jax.distributed.initialize` started."""
    from jax._src.distributed import global_state  # the only handle on the coordination service

    if global_state.client is None:
        raise CheckpointError(
            "jax.process_count() > 1 but jax.distributed was not initialised in this process; "
            "call jax.distributed.initialize() before saving."
        )
    return global_state.client


def coordinator_address() -> str | None:
    """The address of the coordination service, as `jax.distributed.initialize` was given it
    (``host:port``), or None in a single process."""
    from jax._src.distributed import global_state  # as for `coordination_client`

    return global_state.coordinator_address


# What each kind of phases does, and the call every process makes for it, for errors.
_WHAT = {
    "save": ("Saving from", "save"),
    "restore": ("Restoring into", "load"),
    "local": ("Saving the local tier from", "save"),
    "resume": ("Resuming", "latest_step or load"),
    "publish": ("Writing safetensors from", "save_safetensors"),
}


class Phases:
    """The phases of one multi-process save (or restore: ``what="restore"``), run in the
    same order on every process; each phase's name is used once.

    ```python
    phases = Phases()                        # on the caller's thread, in every process
    [tmp] = phases.run("prepare", make_tmp)  # every process gets process 0's result
    ```
    """

    def __init__(self, what: str = "save") -> None:
        """``what``: ``"save"``, ``"restore"``, ``"local"`` (a local-tier save), ``"resume"``
        or ``"publish"`` (`save_safetensors`)."""
        import jax

        self._client = coordination_client()
        self.rank = jax.process_index()
        self.size = jax.process_count()
        self.what = what
        self.name = f"eqxckpt/{what}/{next(_counters[what])}"

    def post(self, key: str, value: str) -> None:
        """Make ``value`` available to other processes under ``key`` (a name used once in
        these phases), for `take`: a value between two processes, no barrier.

        ```python
        phases.post("offer/3", address)   # in process 3
        ```
        """
        self._client.key_value_set(f"{self.name}/posted/{key}", value)

    def take(self, key: str, what: str) -> str:
        """The value another process `post`-ed under ``key``, waiting for it at most the
        barrier timeout; ``what`` names it in the error if it never comes.

        ```python
        address = phases.take("offer/3", "process 3's offer")   # in the process fetching it
        ```
        """
        try:
            return self._client.blocking_key_value_get(f"{self.name}/posted/{key}", int(BARRIER_TIMEOUT_S * 1000))
        except Exception as e:
            doing, call = _WHAT[self.what]
            raise CheckpointError(
                f"{doing} {self.size} processes: {what} did not come within {BARRIER_TIMEOUT_S:.0f}s (its process "
                f"may have crashed or not called {call}). Coordination service said: {e}"
            ) from e

    def forget(self, key: str) -> None:
        """Drop what this process `post`-ed under ``key`` (taken by everyone who needed it)."""
        self._client.key_value_delete(f"{self.name}/posted/{key}")

    def run(self, phase: str, work: Callable[[], str | None], left: Callable[[], str] | None = None) -> list[str]:
        """Run ``work`` here, wait for every process, and return each one's result.

        If any process failed, every process raises: the failing one its own
        exception, the others a `CheckpointError` of the same class naming it.
        ``left`` says, where the others did not all come in time, what the save left
        (by default, for a save: nothing was committed).
        """
        own_error: BaseException | None = None
        try:
            status = {"ok": work() or ""}
        except Exception as e:  # noqa: BLE001 - shared with the other processes, then re-raised
            own_error = e
            status = {"error": str(e), "type": type(e).__name__}
        timeout_ms = int(BARRIER_TIMEOUT_S * 1000)
        try:  # the coordination service may be gone (process 0 died): that is this same failure
            self._client.key_value_set(f"{self.name}/{phase}/{self.rank}", json.dumps(status))
            self._client.wait_at_barrier(f"{self.name}/{phase}", timeout_ms)
            statuses = [
                json.loads(self._client.blocking_key_value_get(f"{self.name}/{phase}/{rank}", timeout_ms))
                for rank in range(self.size)
            ]
        except Exception as e:
            if own_error is not None:
                raise own_error from e
            doing, call = _WHAT[self.what]
            raise CheckpointError(
                f"{doing} {self.size} processes: not every process reached the {phase!r} phase within "
                f"{BARRIER_TIMEOUT_S:.0f}s (one may have crashed or not called {call})."
                + (f" {left()}" if left is not None else " Nothing was committed." if self.what == "save" else "")
                + f" Coordination service said: {e}"
            ) from e
        if own_error is not None:
            raise own_error
        for rank, status in enumerate(statuses):
            if "error" in status:
                cls = getattr(_errors, status["type"], None)
                cls = cls if isinstance(cls, type) and issubclass(cls, CheckpointError) else CheckpointError
                raise cls(f"Process {rank} failed during the {phase!r} phase of the {self.what}: {status['error']}")
        return [status["ok"] for status in statuses]
