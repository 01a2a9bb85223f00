"""`CheckpointManager`: a directory of numbered steps, retention, and resume."""

import contextlib
import math
import os
import signal
import sys
import warnings
import weakref
from typing import Any

import jax
from jaxtyping import PyTree

from ._background import SAVES, SaveHandle
from ._checkpoint import open_checkpoint
from ._errors import ArgumentError, CheckpointChangedError, CheckpointError
from ._formats import open as open_source
from ._load import READ_ATTEMPTS, load
from ._local import LocalCheckpoints, LocalChoice
from ._preemption import Preemption
from ._progress import Progress
from ._replicas import failing_together, spans_processes
from ._retention import Retention
from ._save import save
from ._steps import GONE, MANAGER_KEY, RunSteps, clean_leftovers, manager_record, scan_steps
from ._storage import CheckpointPath, resolve

# How many steps `CheckpointManager.load` tries for the latest one when the one it picked
# was deleted or replaced meanwhile (each time a step that is gone is never picked again).
MAX_LATEST_ATTEMPTS = 32


class CheckpointManager:
    """Checkpoints of a training run as ``directory/<step>``, with retention.

    **Arguments:**

    - `directory`: a local path, URL (``s3://bucket/run``) or kvstore spec dict.
    - `max_to_keep`: keep only the newest this many steps (None: keep all)...
    - `keep_every`: ...plus every step divisible by this, forever...
    - `best_metric`, `best_mode` (``"min"``/``"max"``), `keep_best`: ...plus the
      `keep_best` steps with the best ``metrics[best_metric]``.
    - `save_interval_steps`: `save` skips steps not divisible by this (unless forced).
    - `blocking`: if False (default), saves run in the background, one at a time.
    - `save_on_preemption`: when the job is told it will be stopped, the next
      `save` saves its step whatever the interval, waits until it is committed
      and durable, and ends the process (`SystemExit(0)`; with
      ``exit_on_preemption=False`` it returns, and `reached_preemption` says so).
      The notice is `preemption_signals` (SIGTERM) in a single process; with the
      JAX distributed runtime, JAX's preemption service (it takes SIGTERM on any
      process to every process), so every process saves the same step. True by
      default. The manager listens from its first `save` until it is closed
      (`close`, or the end of its ``with`` block) or garbage-collected. If that
      save fails, the notice stands: the next `save` saves for it.
    - `exit_on_preemption`: if False, `save` returns after saving for a notice
      instead of ending the process.
    - `preemption_signals`: the signals that are a notice in a single process.
      One handler per process serves every manager: installed (from the main
      thread) at the first save that listens, it also calls the handler the
      program had set; it is put back when the last manager stops listening,
      unless the program has set its own handler since (which stays). A
      handler the program sets after the first save should call the one it
      found (`signal.getsignal`) for managers to hear the notice.
    - `preemption_grace_s`: a notice (of a signal whose action was the default,
      which for SIGTERM ends the process) that no `save` answers within this
      many seconds (30 by default; counted again from the end of a save the
      notice came during, or of a failed save for it) ends the process as the
      signal would have, once the saves in flight finish: the signal is never
      swallowed. With no manager listening (all closed), a signal acts as it
      would without eqxckpt.
    - `incremental`: if True (default), leaves unchanged since the latest step
      are shared with it instead of written again (`eqxckpt.save`'s ``base``):
      hard-linked on a local disk, referred to on an object store. What is
      shared is checked first (every chunk's checksum, the leaf's digest): a
      damaged leaf is written again from the values being saved, with a
      warning. False writes every leaf of every step: no step shares a file
      with another, at the cost of writing and storing the unchanged leaves
      each time.
    - `local_path`: a directory on this host (a tmpfs such as ``/dev/shm/run``, or a
      local SSD) for a second, local tier: every `local_interval_steps` steps each
      process saves its own part of the state there (its shards, in the background,
      committed atomically), and `local_replicas` peer processes keep copies of it,
      sent with JAX's transfer service. `latest_step` and `load` then resume from
      the newest step every process can rebuild (from its own copy, else a peer's)
      if it is at least as new as the newest persistent step. Restoring from it
      needs the same processes and mesh (``like`` with the shardings saved from).
      With several processes, `latest_step` and `load` (without ``step``) are
      collective: every process calls them. See the scale guide in the docs.
    - `local_interval_steps`: save to the local tier every this many steps (None:
      `save_interval_steps`).
    - `local_replicas`: how many other processes keep a copy of each process's
      local part (1 by default; placed in other failure domains: slices, hosts).
    - `local_max_to_keep`: how many complete local steps to keep (1 by default).

    Several managers and processes may use one directory (a trainer saving, an
    evaluator polling `latest_step` and loading); see the concurrency protocol
    in the docs. Opening a directory removes what interrupted saves left behind,
    but only what is provably abandoned and eqxckpt's (process 0 only). Entries
    that are not committed steps are skipped with a warning.

    ```python
    with eqxckpt.CheckpointManager("run", max_to_keep=3, save_interval_steps=100) as manager:
        start = manager.latest_step()
        if start is not None:
            state = manager.load(state)
        for step in range(0 if start is None else start + 1, 1000):
            state = train_step(state)
            manager.save(step, state, metrics={"loss": float(loss)})
    ```
    """

    # Retention's arguments, read-only: the policy is fixed when the manager is made.
    max_to_keep = property(lambda self: self.retention.max_to_keep)
    keep_every = property(lambda self: self.retention.keep_every)
    best_metric = property(lambda self: self.retention.best_metric)
    best_mode = property(lambda self: self.retention.best_mode)
    keep_best = property(lambda self: self.retention.keep_best)

    def __init__(
        self,
        directory: CheckpointPath,
        *,
        max_to_keep: int | None = None,
        keep_every: int | None = None,
        save_interval_steps: int = 1,
        best_metric: str | None = None,
        best_mode: str = "min",
        keep_best: int | None = None,
        blocking: bool = False,
        save_on_preemption: bool = True,
        exit_on_preemption: bool = True,
        preemption_signals: tuple[int, ...] = (signal.SIGTERM,),
        preemption_grace_s: float = 30.0,
        incremental: bool = True,
        local_path: str | os.PathLike | None = None,
        local_interval_steps: int | None = None,
        local_replicas: int = 1,
        local_max_to_keep: int = 1,
    ):
        self.retention = Retention(max_to_keep, keep_every, best_metric, best_mode, keep_best)
        if not isinstance(save_interval_steps, int) or save_interval_steps < 1:
            raise ArgumentError(f"save_interval_steps must be a positive int, got {save_interval_steps!r}.")
        if (
            not isinstance(preemption_grace_s, (int, float))
            or isinstance(preemption_grace_s, bool)
            or not 0 < preemption_grace_s < math.inf
        ):
            raise ArgumentError(f"preemption_grace_s must be a positive number of seconds, got {preemption_grace_s!r}.")
        self.location = resolve(directory)
        self.save_interval_steps = save_interval_steps
        self.blocking = blocking
        self.incremental = incremental
        self._pending: SaveHandle | None = None
        self.exit_on_preemption = exit_on_preemption
        self._preemption_signals = preemption_signals if save_on_preemption else None
        self.preemption_grace_s = float(preemption_grace_s)
        # Listening from the first save until the manager is closed or collected (the
        # finalizer: a manager dropped unclosed must not keep the signal).
        self._preemption: Preemption | None = None
        self._stop_listening: weakref.finalize | None = None
        self._preempted_at: int | None = None
        if jax.process_index() == 0 and (left_alone := clean_leftovers(self.location)):
            warnings.warn(left_alone, stacklevel=2)
        scan = scan_steps(self.location)
        if skipped := scan.warning(self.location):
            warnings.warn(skipped, stacklevel=2)
        self._steps = RunSteps(self.location, self.retention, scan)
        self._local: LocalCheckpoints | None = None
        if local_path is not None:
            interval = save_interval_steps if local_interval_steps is None else local_interval_steps
            self._local = LocalCheckpoints(local_path, self._steps, interval, local_replicas, local_max_to_keep)
        # The step `latest_step` agreed on with a local tier, for the `load` that follows.
        self._resume: tuple[LocalChoice | None, int | None] | None = None
        self._resume_persistent: int | None = None

    # -- saving ------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether `save` would save ``step`` without ``force``.

        **Arguments:**

        - `step`: a step number.

        **Returns:** True if ``step`` is a multiple of `save_interval_steps`.

        ```python
        if manager.should_save(step):
            state = gather_state()  # only build what is saved
        ```
        """
        return step % self.save_interval_steps == 0

    def save(
        self,
        step: int,
        tree: PyTree,
        *,
        metadata: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
        force: bool = False,
        progress: Progress = False,
    ) -> bool:
        """Save ``tree`` as step ``step`` (in the background unless ``blocking``).

        **Arguments:**

        - `step`: the step number (a non-negative int); each step is saved once.
        - `tree`: the pytree to save, as for `eqxckpt.save`.
        - `metadata`: a JSON-serialisable dict stored with the step.
        - `metrics`: ``{name: float}``, used by ``best_metric`` retention and `best_step`.
        - `force`: save even if the interval excludes ``step``.
        - `progress`: as for `eqxckpt.save` (a bar on a terminal, or a callable).

        **Returns:** True if the step is being saved, False if the interval skipped it.

        Returns False, saving nothing, for a step the interval excludes (unless
        ``force``). Waits for the previous save first and raises its error, if
        any. Retention runs once this save has committed.

        ```python
        manager.save(step, {"model": model, "opt_state": opt_state}, metrics={"loss": 0.25})
        ```
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ArgumentError(f"step must be a non-negative int, got {step!r}.")
        if self._preemption is None and self._preemption_signals is not None:
            self._preemption = Preemption(self._preemption_signals, self.preemption_grace_s)
            self._stop_listening = weakref.finalize(self, self._preemption.close)
        # Asked at every step, by every process: with several, they agree on the step to save.
        preempted = self._preempted_at is None and self._preemption is not None and self._preemption.reached(step)
        if preempted:
            return self._save_for_preemption(step, tree, metadata, metrics, progress)
        local = self._local is not None and self._local.should_save(step)
        persistent = force or self.should_save(step)
        if not (local or persistent):
            return False
        # A notice's grace period does not end the process in the middle of this save.
        self._resume = None  # what latest_step agreed on is no longer the newest
        if persistent:
            self._steps.check_new(step)  # refused before either tier takes anything
        with self._preemption.saving(for_notice=False) if self._preemption else contextlib.nullcontext():
            try:
                if persistent:
                    self._start(step, tree, metadata, metrics, self.blocking, progress)
            finally:
                if local:
                    assert self._local is not None
                    self._local.save(step, tree, blocking=self.blocking)
        return True

    def _start(
        self,
        step: int,
        tree: PyTree,
        metadata: dict[str, Any] | None,
        metrics: dict[str, float] | None,
        blocking: bool,
        progress: Progress = False,
    ) -> None:
        """Save ``step`` (after the persistent save in flight), then retention; in the
        background unless ``blocking``."""
        self._wait_persistent()
        self._steps.check_new(step)
        metadata = dict(metadata or {})
        if MANAGER_KEY in metadata:
            raise ArgumentError(f"metadata key {MANAGER_KEY!r} is reserved for the manager's own record.")
        metrics = {str(k): _metric(k, v) for k, v in (metrics or {}).items()}
        metadata[MANAGER_KEY] = manager_record(step, metrics)
        # Never overwrite: a committed step is never replaced (another manager
        # that committed this step first makes this save fail instead).
        # Leaves unchanged since the latest step are taken from it, not written again
        # (unless the manager is not incremental).
        committed = self._steps.committed()
        latest = committed[-1] if committed else None
        base = self._steps.step_path(latest) if latest is not None and self.incremental else None
        handle = save(
            self._steps.step_path(step), tree, metadata=metadata, blocking=blocking, progress=progress, base=base
        )
        if blocking:
            self._steps.add(step, metrics)
            return
        # Queued behind the save on the same single background thread, and
        # tracked like a save: the next save waits for it, its error is raised
        # by wait(), by the next save, or printed at exit.
        self._pending = SAVES.submit(handle.path, self._after_save, handle, step, metrics)

    def _save_for_preemption(
        self,
        step: int,
        tree: PyTree,
        metadata: dict[str, Any] | None,
        metrics: dict[str, float] | None,
        progress: Progress,
    ) -> bool:
        """The job will be stopped: save ``step`` now (unless it is saved already), make it
        durable, then end the process (or return, with ``exit_on_preemption=False``).
        If the save fails, the notice stands: the next `save` tries again."""
        assert self._preemption is not None
        with self._preemption.saving(for_notice=True):
            if self._local is not None:  # the fast copy first, then the durable one
                try:
                    self._local.save(step, tree, blocking=True)
                except CheckpointError as e:
                    warnings.warn(f"Preemption notice: the local tier's save of step {step} failed: {e}", stacklevel=3)
            self._wait_persistent()
            if step not in self._steps.committed():
                self._start(step, tree, metadata, metrics, blocking=True, progress=progress)  # committed, durable
        self._preempted_at = step
        if self.exit_on_preemption:
            print(f"eqxckpt: preemption notice; step {step} saved to {self.location}, exiting.", file=sys.stderr)
            raise SystemExit(0)
        return True

    def reached_preemption(self, step: int) -> bool:
        """Whether the job was told it will be stopped and ``step`` was saved for it
        (with ``exit_on_preemption=False``; by default `save` ends the process then).

        **Arguments:**

        - `step`: the step just passed to `save`.

        **Returns:** True once `save` saved ``step`` because of a preemption notice.

        ```python
        for step in range(start, num_steps):
            state = train_step(state)
            manager.save(step, state)
            if manager.reached_preemption(step):
                break
        ```
        """
        return self._preempted_at is not None and step >= self._preempted_at

    def _after_save(self, handle: SaveHandle, step: int, metrics: dict[str, float]) -> None:
        handle.wait()
        self._steps.add(step, metrics)

    def wait(self) -> None:
        """Block until the save in flight (and its retention) is done; raise its error.

        ```python
        manager.save(step, state)
        manager.wait()  # e.g. before the job ends
        ```
        """
        try:
            self._wait_persistent()
        finally:
            if self._local is not None:
                self._local.wait()

    def _wait_persistent(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()
        self._steps.delete_doomed()

    # -- reading -----------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Committed steps, ascending (a save still in flight is not among them).

        **Returns:** a sorted list of ints.

        ```python
        manager.all_steps()  # [200, 300, 400]
        ```
        """
        return self._steps.committed()

    def latest_step(self) -> int | None:
        """The newest committed step, or None if there is none.

        With a local tier (``local_path``), the newest step that every process can
        rebuild from the local tier (its own part or a peer's copy of it), if it is
        no older than the newest persistent step; all processes agree on it (every
        process calls this), and a `load` without ``step`` restores it.

        **Returns:** an int, or None.

        ```python
        start = manager.latest_step()
        state = manager.load(skeleton) if start is not None else init_state()
        ```
        """
        steps = self.all_steps()
        if self._local is None:
            return steps[-1] if steps else None
        self._resume = choice, persistent = self._local.choose(steps[-1] if steps else None)
        return choice.step if choice is not None else persistent

    def best_step(self) -> int | None:
        """The committed step with the best ``metrics[best_metric]``, or None.

        **Returns:** an int, or None when no step has that metric (or no `best_metric` is set).

        ```python
        model = manager.load(skeleton, step=manager.best_step(), at="model")
        ```
        """
        if self.best_metric is None:
            raise CheckpointError("best_step() needs CheckpointManager(best_metric=...).")
        return self._steps.best()

    def metrics(self, step: int) -> dict:
        """The metrics saved with ``step``.

        **Arguments:**

        - `step`: a committed step.

        **Returns:** ``{name: float}``.

        ```python
        manager.metrics(300)  # {'loss': 0.25}
        ```
        """
        return self._steps.metrics(step)

    def metadata(self, step: int | None = None) -> dict:
        """The metadata saved with ``step`` (default: the latest).

        **Arguments:**

        - `step`: a committed step, or None for the latest.

        **Returns:** the ``metadata`` dict that step was saved with (the manager's own
        record, its metrics and step, is kept out of it).

        ```python
        manager.save(100, tree, metadata={"lr": 3e-4})
        manager.wait()
        manager.metadata()["lr"]  # 0.0003
        ```
        """
        metadata = dict(open_checkpoint(self._steps.step_path(self._steps.resolve(step))).metadata)
        metadata.pop(MANAGER_KEY, None)
        return metadata

    def load(
        self, like: PyTree | None = None, *, step: int | None = None, at: str | None = None, **load_kwargs: Any
    ) -> PyTree:
        """`eqxckpt.load` of ``step`` (default: the latest committed one).

        **Arguments:**

        - `like`: as for `eqxckpt.load`.
        - `step`: a committed step, or None for the latest (looked up again if
          another process's retention deletes it meanwhile).
        - `at`: as for `eqxckpt.load`.
        - `load_kwargs`: any other argument of `eqxckpt.load` (``strict``, ``cast``, ``transforms``...).

        **Returns:** the restored pytree.

        ```python
        state = manager.load(eqx.filter_eval_shape(make_state))
        ```
        """
        if self._local is not None:
            restored = self._load_local(like, step, at, load_kwargs)
            if restored is not _FROM_PERSISTENT:
                return restored
            if step is None and self._resume_persistent is not None:
                step = self._resume_persistent  # the persistent step every process agreed on
        # The one place a manager's load retries: it hands `load` an opened checkpoint, which
        # `load` reads once. A step replaced while read is read again; for the latest step,
        # one deleted by another process's retention is never picked again, and the steps
        # are listed again (one process only: several must keep agreeing on their step
        # lists), so a trainer that saves (and deletes) faster than this reads makes it
        # retry, not fail.
        source_format = load_kwargs.pop("format", None)  # opened here: `load` reads it once
        attempts = READ_ATTEMPTS if step is not None else MAX_LATEST_ATTEMPTS
        gone: set[int] = set()
        # As in `load`: a failure here in one process of several restoring together is
        # raised in every one, not left for the others to wait on in `load`.
        together = spans_processes(like)
        for attempt in range(1, attempts + 1):
            try:
                with contextlib.ExitStack() as held:
                    with failing_together(together):
                        chosen = held.enter_context(self._steps.reading(step, gone))
                    try:
                        with failing_together(together):
                            source = open_source(self._steps.step_path(chosen), format=source_format)
                        return load(source, like, at=at, **load_kwargs)
                    except GONE:
                        gone.add(chosen)
                        raise
            except (CheckpointChangedError, *GONE) as e:
                # (Asked only after a change: a first restore's reads then overlap JAX's start-up.)
                last = attempt == attempts or jax.process_count() > 1
                if last or (step is not None and not isinstance(e, CheckpointChangedError)):
                    raise
            if step is None:
                self._steps.rescan()
        raise AssertionError("unreachable")

    def _load_local(self, like: PyTree, step: int | None, at: str | None, load_kwargs: dict) -> Any:
        """`load` from the local tier, if it holds the step asked for (the latest: the one
        `latest_step` agreed on, else agreed now), or `_FROM_PERSISTENT`. A part deleted
        meanwhile (another manager's retention) makes every process choose again."""
        assert self._local is not None
        committed = self._steps.committed()
        resume, self._resume = self._resume, None
        self._resume_persistent = None
        for attempt in range(1, MAX_LATEST_ATTEMPTS + 1):
            if resume is None and (step is None or step not in committed):
                resume = self._local.choose(committed[-1] if committed else None, step=step)
            if resume is None:
                return _FROM_PERSISTENT
            choice, self._resume_persistent = resume
            if choice is None or step not in (None, choice.step):
                return _FROM_PERSISTENT
            try:
                return self._local.restore(choice, like, at=at, **load_kwargs)
            except GONE:
                if attempt == MAX_LATEST_ATTEMPTS:
                    raise
                resume = None
        raise AssertionError("unreachable")

    def path(self, step: int) -> Any:
        """Where ``step`` is stored (a path, or a kvstore spec for object stores).

        **Arguments:**

        - `step`: a step number.

        **Returns:** what `eqxckpt.open`, `load` and `save` accept for it.

        ```python
        eqxckpt.verify(manager.path(manager.latest_step()))
        ```
        """
        return self._steps.step_path(step)

    def __enter__(self) -> "CheckpointManager":
        return self

    def close(self) -> None:
        """Wait for the save in flight (raising its error), and stop listening for
        preemption notices; what `with` does at the end of its block.

        A manager dropped without closing stops listening when it is garbage-collected.
        A later `save` listens again.

        ```python
        manager = eqxckpt.CheckpointManager("run")
        manager.save(0, {"w": np.zeros(3)})
        manager.close()
        ```
        """
        try:
            self.wait()
        finally:
            if self._local is not None:
                self._local.close()
            if self._stop_listening is not None:
                self._stop_listening()  # Preemption.close, once
            self._preemption, self._stop_listening = None, None

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.location)!r}, steps={self.all_steps()})"


# What `_load_local` returns when the step is to be read from the persistent tier.
_FROM_PERSISTENT: Any = object()


def _metric(name: Any, value: Any) -> float:
    """A metric as the float the manager records, or an `ArgumentError` naming it."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ArgumentError(f"metric {name!r} must be a number, got {value!r}.") from None
