"""Background saves: one thread, one save at a time, and no failure ever lost."""

import atexit
import concurrent.futures
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .._errors import CheckpointError


class SaveHandle:
    """A save in progress (or done). ``wait()`` blocks and re-raises its error.

    ```python
    handle = eqxckpt.save("ckpt", tree, blocking=False)
    ...  # keep training
    handle.wait()
    ```
    """

    def __init__(self, path: str, future: concurrent.futures.Future):
        self.path = path
        self._future = future
        self.observed = False  # whether its outcome was seen (by wait() or the next save)
        self._pid = os.getpid()  # a forked child has no thread to finish it: not its to wait on

    def _forked_away(self) -> bool:
        return os.getpid() != self._pid and not self._future.done()

    def done(self) -> bool:
        """Whether the save has finished (successfully or not).

        **Returns:** True once it committed or failed.

        ```python
        if handle.done():
            handle.wait()  # raises its error, if any
        ```
        """
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save is committed; re-raise its exception if it failed.

        **Arguments:**

        - `timeout`: seconds to wait at most (None: no limit); `TimeoutError` after.

        In a process forked while the save ran (a data loader's worker), returns at once:
        the save is the parent's, whose thread finishes it.

        ```python
        eqxckpt.save("ckpt", tree, blocking=False).wait()
        ```
        """
        self.observed = True
        if self._forked_away():
            return
        self._future.result(timeout)

    def error(self) -> BaseException | None:
        """The save's exception, once it has finished; blocks until then.

        **Returns:** the exception, or None if the save succeeded.

        ```python
        if (error := handle.error()) is not None:
            log(error)
        ```
        """
        if self._forked_away():
            return None  # the parent's to report
        return self._future.exception()

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"SaveHandle({self.path!r}, {state})"


class BackgroundSaves:
    """Work behind saves (writes, then a manager's retention) on one thread, in order.

    A handle stays tracked until it succeeds or its error is seen; a failure
    nobody saw fails the next save before it starts, or is printed at exit.
    """

    def __init__(self) -> None:
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._in_flight: dict[str, SaveHandle] = {}  # latest background work per location
        self._lock = threading.Lock()

    def submit(self, key: str, work: Callable[..., Any], *args: Any) -> SaveHandle:
        """Run ``work(*args)`` after everything submitted before; a handle on it for ``key``."""
        with self._lock:
            handle = SaveHandle(key, self.executor().submit(work, *args))
            self._in_flight[key] = handle
        handle._future.add_done_callback(lambda _: self._forget(key, handle))
        return handle

    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The one background thread (started on first use)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="eqxckpt-save")
            # Registered now, after jax.distributed.initialize registered its own
            # shutdown, so this runs first (atexit is last-in, first-out) and a
            # multi-process save can still reach its barriers.
            atexit.register(self.finish_at_exit)
        return self._executor

    def _forget(self, key: str, handle: SaveHandle) -> None:
        with self._lock:
            if self._in_flight.get(key) is handle and handle.error() is None:
                del self._in_flight[key]

    def wait_idle(self, timeout: float | None = None) -> list[str]:
        """Wait for all work submitted so far to finish, at most ``timeout`` seconds (None:
        however long); its errors stay for whoever waits on it.

        **Returns:** the paths of the saves still running when the wait ended (none if idle).
        """
        with self._lock:
            previous = list(self._in_flight.values())
        deadline = None if timeout is None else time.monotonic() + timeout
        for handle in previous:
            if deadline is None:
                handle.error()
            else:
                try:
                    handle.wait(max(0.0, deadline - time.monotonic()))
                except Exception:  # noqa: BLE001 - its error stays for its waiter; a timeout leaves it running
                    pass
        return [handle.path for handle in previous if not handle.done()]

    def settle(self) -> None:
        """Wait for all work in flight (so at most one snapshot is held in memory), then
        raise an error no one has seen yet, so that a failed save is never silently lost."""
        self.wait_idle()
        with self._lock:
            failed = [h for h in self._in_flight.values() if h.done() and h.error() is not None]
            for handle in failed:
                del self._in_flight[handle.path]
        for handle in failed:
            if not handle.observed:
                handle.observed = True
                error = handle.error()
                raise CheckpointError(
                    f"An earlier background save to {handle.path} failed, so this save was not started: "
                    f"{error}. That checkpoint was not written; fix the cause and save again."
                ) from error

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's saves and their thread are the parent's (its
        futures would never finish here, and the child's exit would wait on them for ever);
        the child starts with none, and a thread of its own if it saves."""
        self._executor = None
        self._in_flight = {}
        self._lock = threading.Lock()

    def finish_at_exit(self) -> None:
        """A background save must not vanish with the interpreter, nor its error: a failure
        no one saw is printed, and the process exits with status 1 (a script or scheduler
        that checks the status learns that its checkpoint was not written)."""
        failed = False
        for handle in list(self._in_flight.values()):
            error = handle.error()
            if error is not None and not handle.observed:
                print(f"eqxckpt: background save to {handle.path} failed: {error!r}", file=sys.stderr)
                failed = True
        if failed:
            # atexit cannot change the exit status; os._exit can, once output is flushed.
            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os._exit(1)


SAVES = BackgroundSaves()
os.register_at_fork(after_in_child=SAVES.reset_after_fork)
