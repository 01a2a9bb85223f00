"""Preemption notices: one process-wide signal listener that managers join and leave."""

import contextlib
import math
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import jax

from .._errors import ArgumentError
from .._write._background import SAVES


class _Listener:
    """The handler eqxckpt installs for preemption signals, shared by the whole process.

    Installed once per signal, from the main thread, chaining to the disposition found
    then; put back when the last manager listening for that signal leaves, and only if
    ours is still the current handler (a handler the program set since stays, and is
    never replaced). With no manager listening, the signal does what it would have
    done without eqxckpt. A notice that no manager's save answers within the grace
    period ends the process as the signal would have, once the saves in flight finish,
    or, where they do not finish within one more grace period (an object store that
    stopped answering), without them, naming what it gave up on.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entrant: the handler runs in whichever frame the main thread was in
        self._members: frozenset[Preemption] = frozenset()
        self._found: dict[int, Any] = {}  # signal -> the disposition found when ours was installed
        self._armed: dict[int, float] = {}  # signal -> when a notice no save has answered ends the process
        self._grace: dict[int, float] = {}  # signal -> its grace period: saves running past due get one more
        self._forced: set[int] = set()  # signals the watchdog sent itself with saves still running
        self._gave_up: list[str] = []  # what those saves were
        self._ending: set[int] = set()  # signals the watchdog sent itself: the handler passes them on
        self._saving = 0  # managers' saves running now: the process is not ended under them
        self._notices = 0  # notices armed so far (a save tells whether one came while it ran)
        self._wake = threading.Event()
        self._watchdog: threading.Thread | None = None
        # One bound method, so that `signal.getsignal(s) is self.handler` says whether ours is current.
        self.handler = self._handle

    def reset_after_fork(self) -> None:
        """In a forked child: none of the parent's managers listen here and its watchdog
        is gone; the handler stays, so a signal does what it would without them."""
        self._lock = threading.RLock()
        self._members = frozenset()
        self._armed, self._ending, self._grace, self._forced = {}, set(), {}, set()
        self._saving = self._notices = 0
        self._wake = threading.Event()
        self._watchdog = None

    def join(self, member: "Preemption") -> None:
        """Deliver ``member.signals`` to ``member`` from now on (installing the handler from
        the main thread; a handler cannot be installed from another thread)."""
        with self._lock:
            self._members |= {member}
            if threading.current_thread() is threading.main_thread():
                for signum in member.signals:
                    if signum in self._found:
                        continue  # installed once: installing again would chain ours to itself
                    found = signal.getsignal(signum)
                    if found is None or found == signal.SIG_IGN:
                        # Set outside Python (it could be neither called nor put back), or
                        # ignored by the program: no notice comes by this signal.
                        continue
                    signal.signal(signum, self.handler)
                    self._found[signum] = found
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="eqxckpt-preemption", daemon=True)
                self._watchdog.start()

    def leave(self, member: "Preemption") -> None:
        """Stop delivering to ``member``; put back what ours replaced if no one else listens
        and ours is still current (from the main thread; elsewhere ours stays, passing
        signals on as they would have gone)."""
        with self._lock:
            self._members -= {member}
            if threading.current_thread() is not threading.main_thread():
                return
            for signum, found in list(self._found.items()):
                if any(signum in m.signals for m in self._members):
                    continue
                if signal.getsignal(signum) is self.handler:
                    signal.signal(signum, found)
                    del self._found[signum]
                # Otherwise the program set its own handler since: it stays (and ours stays in
                # its chain, passing the signal on, if it calls the handler it found).
        self._wake.set()  # the watchdog ends when no one listens and no notice is pending

    @contextlib.contextmanager
    def saving(self, grace_s: float, for_notice: bool) -> Iterator[None]:
        """A manager's save runs: no grace period ends the process until it is done.

        ``for_notice``: the save for the notice, which answers it if it succeeds. If it
        fails, or if the notice came while it ran, the notice gets another ``grace_s``
        from its end for the next save to answer it.
        """
        with self._lock:
            self._saving += 1
            notices = self._notices
        succeeded = False
        try:
            yield
            succeeded = True
        finally:
            with self._lock:
                self._saving -= 1
                if succeeded and for_notice:
                    self._armed.clear()
                elif for_notice or self._notices != notices:
                    due = time.monotonic() + grace_s
                    for signum in self._armed:
                        self._armed[signum] = max(self._armed[signum], due)
            self._wake.set()

    def _handle(self, signum: int, frame: Any) -> None:
        with self._lock:
            found = self._found.get(signum, signal.SIG_DFL)
            if signum in self._ending:  # sent by the watchdog: the grace period ran out
                self._ending.discard(signum)
                forced = signum in self._forced
                self._forced.discard(signum)
                if signum not in self._armed or (self._saving and not forced):  # answered meanwhile, or a save runs
                    self._wake.set()
                    return
                del self._armed[signum]
                members = []
                _announce(signum, self._gave_up if forced else [])
            else:
                members = [m for m in self._members if signum in m.signals]
            # Called by the signal itself, or by a handler the program set later that calls
            # the one it found (ours): either way ours stands for the disposition it found,
            # so a default action is delayed for the managers' save, never dropped.
            for member in members:
                member.noticed = True
            arm = bool(members) and found == signal.SIG_DFL and signum not in self._armed
            if arm:
                self._grace[signum] = max(m.grace_s for m in members)
                self._armed[signum] = time.monotonic() + self._grace[signum]
                self._notices += 1
        if arm:
            self._wake.set()
        if members:
            if callable(found):
                found(signum, frame)
        else:
            self._pass_on(signum, found, frame)

    def _pass_on(self, signum: int, found: Any, frame: Any) -> None:
        """Do what the signal would have done without eqxckpt (in the main thread)."""
        if callable(found):
            found(signum, frame)
        elif found == signal.SIG_DFL:
            current = signal.getsignal(signum)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)  # ends the process, if that is what the default does
            signal.signal(signum, current)

    def _watch(self) -> None:
        """The watchdog thread: ends the process once a notice's grace period is over and
        no save runs; it stops when no one listens and no notice is pending."""
        while True:
            self._wake.clear()  # before reading the state: a change after this wakes the wait below
            with self._lock:
                if not self._members and not self._armed:
                    self._watchdog = None  # the next join starts another
                    return
                waiting = {signum: due for signum, due in self._armed.items() if signum not in self._ending}
                # Past its grace period a notice waits for the saves running, one more at most.
                last = min((due + self._grace.get(s, 0.0) for s, due in waiting.items()), default=None)
                due = last if self._saving else min(waiting.values(), default=None)
            if due is None or due > time.monotonic():
                self._wake.wait(None if due is None else due - time.monotonic())
                continue
            assert last is not None
            running = SAVES.wait_idle(timeout=max(0.0, last - time.monotonic()))
            self._end(running, force=time.monotonic() >= last)

    def _end(self, running: list[str], force: bool) -> None:
        """End the process for the notices past their grace period: once no save runs, or
        (``force``) past one more grace period whatever still runs (``running``: the
        background saves given up on)."""
        send: list[int] = []
        with self._lock:
            if self._saving and not force:
                return  # a save started meanwhile: it may answer the notice
            if running and not force:
                return  # looked at again: they finished since, or their time is up
            gave_up = running + (["a save of the manager's, still running"] if self._saving else [])
            now = time.monotonic()
            for signum, due in list(self._armed.items()):
                if due > now or signum in self._ending:
                    continue
                current = signal.getsignal(signum)
                if current == signal.SIG_DFL:
                    del self._armed[signum]  # ours was put back: the default ends the process
                    _announce(signum, gave_up)
                    send.append(signum)
                elif callable(current):
                    # Ours, or the program's that called ours for the notice: ours (in the
                    # main thread) passes it on.
                    self._ending.add(signum)
                    if gave_up:
                        self._forced.add(signum)
                        self._gave_up = gave_up
                    send.append(signum)
                else:
                    del self._armed[signum]  # the program ignores the signal now
        for signum in send:
            # At the main thread, where Python runs handlers: sent to the process from this
            # thread, it is delivered here, and a main thread asleep (or in a blocking call)
            # would not run ours until it woke.
            signal.pthread_kill(threading.main_thread().ident or 0, signum)


def _announce(signum: int, gave_up: list[str]) -> None:
    given_up = (
        f" Gave up on the saves still running after another preemption_grace_s (a store that stopped "
        f"answering, or a save slower than that: raise preemption_grace_s): "
        f"{', '.join(gave_up)}. Each is committed whole only if it had written its commit before it was "
        "given up (then a new manager lists it); else nothing of it is."
        if gave_up
        else ""
    )
    print(
        f"eqxckpt: {signal.Signals(signum).name} received and no checkpoint saved for it within "
        f"preemption_grace_s; ending the process as the signal would have.{given_up}",
        file=sys.stderr,
        flush=True,
    )


LISTENER = _Listener()
# A worker forked after a manager's first save (a data loader's) must still die on SIGTERM.
os.register_at_fork(after_in_child=LISTENER.reset_after_fork)


class Preemption:
    """Whether the job has been told it will be stopped: one manager's view of the notice.

    With the JAX distributed runtime and its preemption service, JAX's own notice (it
    handles SIGTERM and tells every process), asked through
    `multihost_utils.reached_preemption_sync_point` so that every process answers True
    at the same step. In a single process, ``signals`` (SIGTERM) caught by the one
    process-wide handler (installed from the main thread), which tells every manager
    listening; a handler the program had set is still called. Several processes
    without the service get no notice: one process alone saving would leave the rest
    waiting.
    """

    def __init__(self, signals: tuple[int, ...], grace_s: float):
        self.signals = frozenset(signals)
        self.grace_s = grace_s
        self.noticed = False  # a notice no save of this manager has answered yet
        self._jax = jax.process_count() > 1
        self._listening = not self._jax
        if self._listening:
            LISTENER.join(self)

    def reached(self, step: int) -> bool:
        """Whether a notice came that this manager has not saved for yet."""
        if not self._jax:
            return self.noticed
        from jax.experimental import multihost_utils

        try:
            return multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError:  # the preemption service is off: no notice can come
            return False

    @contextlib.contextmanager
    def saving(self, for_notice: bool) -> Iterator[None]:
        """A save of this manager runs; ``for_notice``: it is the save for the notice, which
        it answers if it succeeds, and leaves standing (for the next save) if it fails."""
        with LISTENER.saving(self.grace_s, for_notice):
            yield
        if for_notice:
            self.noticed = False

    def close(self) -> None:
        """Stop listening (idempotent; also called when the manager is garbage-collected)."""
        if self._listening:
            self._listening = False
            LISTENER.leave(self)


class Notices:
    """A manager's preemption notices: listened for from its first save (`listen`) until it
    is closed (`stop`) or garbage-collected, and the step it saved for one.

    **Arguments:**

    - `signals`: the signals that are a notice in a single process (None: not listening).
    - `grace_s`: as for `CheckpointManager`'s ``preemption_grace_s``.

    ```python
    notices = Notices((signal.SIGTERM,), 30.0)
    notices.listen(manager)
    ```
    """

    def __init__(self, signals: tuple[int, ...] | None, grace_s: float):
        try:
            finite = 0 < float(grace_s) < math.inf
        except (TypeError, ValueError, OverflowError):
            finite = False
        if not isinstance(grace_s, (int, float)) or isinstance(grace_s, bool) or not finite:
            raise ArgumentError(f"preemption_grace_s must be a positive number of seconds, got {grace_s!r:.100}.")
        catchable = signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}
        for signum in signals or ():
            if isinstance(signum, bool) or not isinstance(signum, int) or signum not in catchable:
                raise ArgumentError(
                    f"preemption_signals must be signals a process can catch (signal.SIGTERM...), got {signum!r:.100}."
                )
        self.signals, self.grace_s = signals, float(grace_s)
        self.saved_at: int | None = None  # the step saved for a notice
        self._preemption: Preemption | None = None
        self._stop: weakref.finalize | None = None

    def listen(self, owner: object) -> None:
        """Listen, if not yet, until `stop` or until ``owner`` is collected (the finalizer: a
        manager dropped unclosed must not keep the signal)."""
        if self._preemption is None and self.signals is not None:
            self._preemption = Preemption(self.signals, self.grace_s)
            self._stop = weakref.finalize(owner, self._preemption.close)

    def reached(self, step: int) -> bool:
        """Whether a notice came that no save answered (asked at every step, by every
        process: with several, they agree on the step to save)."""
        return self.saved_at is None and self._preemption is not None and self._preemption.reached(step)

    def saving(self, for_notice: bool) -> contextlib.AbstractContextManager:
        """A save runs (as for `Preemption.saving`; nothing if not listening): a notice's
        grace period does not end the process in the middle of it."""
        return self._preemption.saving(for_notice) if self._preemption else contextlib.nullcontext()

    def stop(self) -> None:
        """Stop listening (a later `listen` listens again)."""
        if self._stop is not None:
            self._stop()  # Preemption.close, once
        self._preemption, self._stop = None, None
