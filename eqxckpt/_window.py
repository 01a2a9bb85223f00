"""The I/O threads, the one bounded window of work in flight that saves, restores,
`verify` and copies all go through, and the host memory that work may hold: the budget
a restore may hold beyond its result (`load`'s ``host_memory_budget``), the window of
reads in flight that follows from it, the slab a pass over a whole checkpoint holds at
once, and refusing an allocation larger than what the machine has left."""

import collections
import concurrent.futures
import contextlib
import contextvars
import functools
import os
import queue
import threading
import types
from collections.abc import Callable, Coroutine, Generator, Iterable, Iterator, Sequence
from typing import Any, Protocol

from ._errors import ArgumentError, CheckpointError

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
        raise ArgumentError(f"host_memory_budget must be a positive number of bytes, got {nbytes!r}.")
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


# Chunk reads and writes block in the kernel and checksums run in C with the GIL
# released: more threads than cores keeps a disk's queue busy. Requests to an object
# store hold no thread while they are in flight (`done`): the window bounds those.
IO_THREADS = 8


class Waitable(Protocol):
    """What a task's coroutine may wait for (`done`): a TensorStore future, for one."""

    def add_done_callback(self, callback: Callable[[Any], None], /) -> None: ...


class _Done:
    """The awaitable `done` returns: a coroutine awaiting it hands its futures to whoever
    drives it (the pool, or `blocking`) and resumes once they are all done."""

    def __init__(self, futures: Sequence[Waitable]):
        self.futures = futures

    def __await__(self) -> Generator["_Done", None, None]:
        yield self


def done(futures: Sequence[Waitable]) -> _Done:
    """Await, in a task's coroutine, until every one of ``futures`` is done (succeeded or
    failed: ask each for its result afterwards). Meanwhile the coroutine holds no I/O
    thread; it goes on, on one of them, once the last is done.

    ```python
    async def work():
        found = store.read(key)
        await done([found])
        return found.result()
    ```
    """
    return _Done(futures)


async def completed(result: Any) -> Any:
    """A task's result: ``result`` of its work, awaited if that is a coroutine (a task that
    wraps another's work)."""
    return await result if isinstance(result, types.CoroutineType) else result


def _when_all(futures: Sequence[Waitable], then: Callable[[], None]) -> None:
    """Call ``then`` (on whichever thread finishes the last) once all ``futures`` are done."""
    left = [len(futures)]
    lock = threading.Lock()

    def one(_: Any) -> None:
        with lock:
            left[0] -= 1
            last = not left[0]
        if last:
            then()

    if not futures:
        then()
    for future in futures:
        future.add_done_callback(one)


def blocking(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """Run a task's coroutine to its end on this thread, blocking while it waits (a window
    run inline, on an I/O thread), and return its result."""
    while True:
        try:
            step = coroutine.send(None)
        except StopIteration as stop:
            return stop.value
        assert isinstance(step, _Done), step
        ready = threading.Event()
        _when_all(step.futures, ready.set)
        ready.wait()


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
        """Run ``work`` on a thread of the pool. If it returns a coroutine (an ``async def``
        task), that is driven on the pool: it holds no thread while it awaits `done`, and
        the future is its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        # The caller's host memory budget holds in the task too (its reads bound themselves by it).
        self._put(functools.partial(self._start, work, future, host_memory_budget()))
        return future

    def _put(self, job: Callable[[], None]) -> None:
        with self._lock:
            # A thread more only when none is free: a process's first restore does not wait
            # to start threads it would leave idle.
            if self._idle <= self._tasks.qsize() and len(self._threads) < self._size:
                thread = threading.Thread(target=self._serve, name="eqxckpt-io", daemon=True)
                thread.start()
                self._threads.append(thread)
        self._tasks.put(job)

    def _start(self, work: Callable[[], Any], future: concurrent.futures.Future, budget: int) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = _within(budget, work)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(e)
            return
        if isinstance(result, types.CoroutineType):
            self._step(result, future, budget)
        else:
            future.set_result(result)

    def _step(self, coroutine: Coroutine[Any, Any, Any], future: concurrent.futures.Future, budget: int) -> None:
        """Run ``coroutine`` until it awaits `done` (then again, on this pool, once its
        futures are) or ends (then settle ``future``)."""
        try:
            step = _within(budget, coroutine.send, None)
        except StopIteration as stop:
            future.set_result(stop.value)
            return
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(e)
            return
        if not isinstance(step, _Done):
            coroutine.close()
            future.set_exception(TypeError(f"an I/O task awaited {step!r}; it may only await eqxckpt's done()"))
            return
        _when_all(step.futures, lambda: self._put(functools.partial(self._step, coroutine, future, budget)))

    def _serve(self) -> None:
        _worker.active = True
        while True:
            with self._lock:
                self._idle += 1
            job = self._tasks.get()
            with self._lock:
                self._idle -= 1
            job()
            del job  # an idle thread must not keep the last task's buffers alive

    def reset_after_fork(self) -> None:  # a forked child has none of its parent's threads
        self.__init__(self._size)


def _within(budget: int, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)`` with `host_memory_budget` at ``budget`` (a submitter's, on a pool thread)."""
    token = _HOST_MEMORY_BUDGET.set(budget)
    try:
        return call(*args)
    finally:
        _HOST_MEMORY_BUDGET.reset(token)


_worker = threading.local()  # ``active`` on the pool's own threads
_POOL = _Pool(IO_THREADS)
os.register_at_fork(after_in_child=_POOL.reset_after_fork)


# One unit of work: the bytes it holds while in flight, the work (run on an I/O thread;
# it may return a coroutine that awaits `done`, see `_Pool.submit`), and what to do with
# its result (on the caller's thread, in order).
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
            result = work()
            yield then, blocking(result) if isinstance(result, types.CoroutineType) else result
        return
    pending: collections.deque[tuple[int, concurrent.futures.Future, Callable[[Any], None] | None]]
    pending = collections.deque()
    in_flight = 0
    try:
        for nbytes, work, then in tasks:
            while pending and in_flight + nbytes > window:
                # Taken off only once settled: an interrupt while waiting still waits for it below.
                done, future, settle = pending[0]
                result = future.result()
                pending.popleft()
                in_flight -= done
                yield settle, result
            pending.append((nbytes, _POOL.submit(work), then))
            in_flight += nbytes
        while pending:
            done, future, settle = pending[0]
            result = future.result()
            pending.popleft()
            in_flight -= done
            yield settle, result
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
