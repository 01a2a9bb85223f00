"""The I/O threads, and the one bounded window of work in flight that saves, restores,
`verify` and copies all go through."""

import collections
import concurrent.futures
import contextlib
import os
import queue
import threading
from collections.abc import Callable, Generator, Iterable
from typing import Any

# Chunk reads and writes block in the kernel or on the network and checksums run in C
# with the GIL released: more threads than cores keeps a disk's queue and a store's
# connections busy.
IO_THREADS = 8


class _Pool:
    """Daemon worker threads. Not a `concurrent.futures` executor: a background save may
    still be writing while the interpreter exits, when executors take no new work."""

    def __init__(self, size: int):
        self._size = size
        self._lock = threading.Lock()
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for a task

    def submit(self, work: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            # A thread more only when none is free: a process's first restore does not wait
            # to start threads it would leave idle.
            if self._idle <= self._tasks.qsize() and len(self._threads) < self._size:
                thread = threading.Thread(target=self._serve, name="eqxckpt-io", daemon=True)
                thread.start()
                self._threads.append(thread)
        self._tasks.put((work, future))
        return future

    def _serve(self) -> None:
        _worker.active = True
        while True:
            with self._lock:
                self._idle += 1
            work, future = self._tasks.get()
            with self._lock:
                self._idle -= 1
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(work())
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(e)
            del work, future  # an idle thread must not keep the last task's buffers alive

    def _forget(self) -> None:  # a forked child has none of its parent's threads
        self.__init__(self._size)


_worker = threading.local()  # ``active`` on the pool's own threads
_POOL = _Pool(IO_THREADS)
os.register_at_fork(after_in_child=_POOL._forget)


# One unit of work: the bytes it holds while in flight, the work (run on an I/O thread),
# and what to do with its result (on the caller's thread, in order).
Task = tuple[int, Callable[[], Any], Callable[[Any], None] | None]


def run_windowed(tasks: Iterable[Task], window: int) -> None:
    """Run ``tasks`` on the I/O threads in order, with at most ``window`` bytes started and
    not yet settled (always at least one task), settling them in order: each task's
    ``then`` gets its result on the caller's thread.

    If one fails, no further task starts; every started one is waited for (nothing still
    reads or writes when the caller cleans up or returns), then the first failure is
    raised. A ``KeyboardInterrupt`` waits the same way. Called from an I/O thread (a
    task that reads another source), the tasks run there, one after another.

    ```python
    run_windowed([(n, lambda n=n: n * 2, print) for n in (1, 2, 3)], window=2)  # prints 2, 4, 6
    ```
    """
    with contextlib.closing(windowed(tasks, window)) as results:
        for then, result in results:
            if then is not None:
                then(result)


def windowed(tasks: Iterable[Task], window: int) -> Generator[tuple[Callable[[Any], None] | None, Any], None, None]:
    """``(then, result)`` of each of ``tasks`` in order, as `run_windowed` runs them: the
    window is kept full while the caller consumes them, so it may pull them one at a
    time (a sharded restore places each slice as it arrives). Close it
    (``contextlib.closing``) to wait for what it started."""
    if getattr(_worker, "active", False):
        # Called from a task (a copy reading its source): run inline, in order. Waiting
        # on the pool from inside it could leave every thread waiting on queued work.
        for _, work, then in tasks:
            yield then, work()
        return
    pending: collections.deque[tuple[int, concurrent.futures.Future, Callable[[Any], None] | None]]
    pending = collections.deque()
    in_flight = 0
    try:
        for nbytes, work, then in tasks:
            while pending and in_flight + nbytes > window:
                done, future, settle = pending.popleft()
                in_flight -= done
                yield settle, future.result()
            pending.append((nbytes, _POOL.submit(work), then))
            in_flight += nbytes
        while pending:
            done, future, settle = pending.popleft()
            in_flight -= done
            yield settle, future.result()
    finally:  # a failure, an interrupt or a consumer that stopped: every started task settles
        while True:
            try:
                concurrent.futures.wait([future for _, future, _ in pending])
                break
            except KeyboardInterrupt:
                continue


_jax_started = threading.Event()


def start_jax() -> None:
    """Start JAX's backend on a thread of its own, once per process, so that a process's
    first restore reads while JAX starts (mostly finding its plugins) instead of before
    or after.

    Not a daemon: the interpreter waits for it at exit. A daemon thread still inside
    XLA's client creation when the interpreter finalizes is unwound by ``pthread_exit``
    as it takes the GIL back, through C++ that catches and does not rethrow: the process
    aborts ("FATAL: exception not rethrown"), e.g. one whose load was refused at once."""
    if not _jax_started.is_set():
        _jax_started.set()
        import jax

        def start() -> None:
            try:
                jax.local_devices()
            except Exception:  # noqa: BLE001 - the restore that needs JAX raises it, on its own thread
                pass

        try:
            threading.Thread(target=start, name="eqxckpt-jax-start").start()
        except RuntimeError:  # the interpreter is exiting: whoever needs JAX starts it
            pass
