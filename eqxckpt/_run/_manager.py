"""`CheckpointManager`: which steps are saved (intervals, ``force``, preemption), handed
to its tiers (`_tiers`: persistent, and local if asked), and resumed from them."""

import os
import signal
import sys
from typing import Any

from jaxtyping import PyTree

from .._arguments import checked_arguments
from .._distributed import process_count
from .._errors import ArgumentError, CheckpointError
from .._process_state import SavedState
from .._progress import Progress
from .._storage import CheckpointPath, resolve
from .._write._reuse import FULL_CHECK_INTERVAL_S
from ._preemption import Notices
from ._retention import Retention
from ._tiers import Details, LocalSettings, PersistentTier, Resume, StateRequest, Tiers


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
    - `save_on_preemption`: when the job is told it will be stopped (every process,
      with JAX's distributed runtime), the next `save` saves its step whatever the
      interval, waits until it is durable, and ends the process (`SystemExit(0)`).
      Listens from the first `save` until closed (see the scale guide's Preemption).
    - `exit_on_preemption`: if False, `save` returns instead (`reached_preemption`).
    - `preemption_signals`: the signals that are a notice in a single process.
    - `preemption_grace_s`: a notice no `save` answers within this many seconds
      ends the process as its signal would have: it is never swallowed.
    - `incremental`: if True (default), leaves unchanged since an earlier step are
      shared with it (`eqxckpt.save`'s ``base``); False writes every leaf every step.
    - `kept_copies`: how many physical copies of each leaf the kept steps hold (2): a
      step writes a leaf afresh rather than share it where sharing would leave one copy
      behind every kept step, so a flipped bit in one is mended from another
      (``eqxckpt verify --repair``). 1 shares every unchanged leaf with the latest step.
    - `full_check_interval_s`: how long a leaf shared unchanged is shared without
      reading it, once checked whole, while its files' stamps (local disks) or objects'
      generations (S3, Cloud Storage) stay those it was checked at (`eqxckpt.save`'s; one
      hour by default, at most 100 steps; 0: every step reads and checks every leaf it
      shares).
    - `local_path`: a directory on this host (a tmpfs, a local SSD) for a local tier:
      each process saves its part there and peers keep copies; `latest_step` and
      `load` resume from it first, every process together (see the scale guide).
    - `local_interval_steps`: save to the local tier every this many steps (None:
      `save_interval_steps`).
    - `local_replicas`: how many other processes keep a copy of each process's part (1).
    - `local_max_to_keep`: how many complete local steps to keep (1).

    ```python
    with eqxckpt.CheckpointManager("run", max_to_keep=3, save_interval_steps=100) as manager:
        start = manager.latest_step()
        state = state if start is None else manager.load(state)
        for step in range(0 if start is None else start + 1, 1000):
            state = train_step(state)
            manager.save(step, state, metrics={"loss": float(loss)})
    ```
    """

    # Arguments, read-only: the policy is fixed when the manager is made.
    max_to_keep = property(lambda self: self.retention.max_to_keep)
    keep_every = property(lambda self: self.retention.keep_every)
    best_metric = property(lambda self: self.retention.best_metric)
    best_mode = property(lambda self: self.retention.best_mode)
    keep_best = property(lambda self: self.retention.keep_best)
    save_interval_steps = property(lambda self: self._persistent.interval)
    incremental = property(lambda self: self._persistent.incremental)
    kept_copies = property(lambda self: self._persistent.copies)
    preemption_grace_s = property(lambda self: self._notices.grace_s)

    @checked_arguments
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
        kept_copies: int = 2,
        full_check_interval_s: float = FULL_CHECK_INTERVAL_S,
        local_path: str | os.PathLike | None = None,
        local_interval_steps: int | None = None,
        local_replicas: int = 1,
        local_max_to_keep: int = 1,
    ):
        self.retention = Retention(max_to_keep, keep_every, best_metric, best_mode, keep_best)
        self._notices = Notices(preemption_signals if save_on_preemption else None, preemption_grace_s)
        self.location = resolve(directory)
        self.blocking = blocking
        self.exit_on_preemption = exit_on_preemption
        self._persistent = PersistentTier.opened(
            self.location, self.retention, save_interval_steps, incremental, kept_copies, full_check_interval_s
        )
        interval = save_interval_steps if local_interval_steps is None else local_interval_steps
        local = None if local_path is None else LocalSettings(local_path, interval, local_replicas, local_max_to_keep)
        self._tiers = Tiers(self._persistent, local)
        # What `latest_step` chose, for the `load` that follows; a save drops it.
        self._resume: Resume | None = None

    @checked_arguments
    def should_save(self, step: int) -> bool:
        """Whether `save` would save ``step`` (a step number) without ``force``.

        **Returns:** True if ``step`` is a multiple of `save_interval_steps`.

        ```python
        state = gather_state() if manager.should_save(step) else None  # only build what is saved
        ```
        """
        if step < 0:
            raise ArgumentError(f"step must be a non-negative int, got {step!r}.")
        return self._persistent.should_save(step)

    @checked_arguments
    def save(
        self,
        step: int,
        tree: PyTree,
        *,
        metadata: dict[str, Any] | None = None,
        metrics: dict[str, float] | None = None,
        force: bool = False,
        progress: Progress = "auto",
        process_state: Any = None,
    ) -> bool:
        """Save ``tree`` as step ``step`` (in the background unless ``blocking``).

        **Arguments:**

        - `step`: the step number (a non-negative int); each step is saved once.
        - `tree`: the pytree to save, as for `eqxckpt.save`.
        - `metadata`: a JSON-serialisable dict stored with the step.
        - `metrics`: ``{name: float}``, used by ``best_metric`` retention and `best_step`.
        - `force`: save even if the interval excludes ``step``.
        - `progress`: as for `eqxckpt.save` (a bar on a terminal, or a callable).
        - `process_state`: this process's own small state, saved with the step in every
          tier and atomically with it: a Grain iterator (or anything with
          ``get_state()``; its state is taken now), bytes or a JSON value. Each process
          passes its own; `load` gives each its own back.

        **Returns:** True if the step is being saved, False if the interval skipped it.
        Waits for the previous save first and raises its error, if any. Retention runs
        once this save has committed.

        ```python
        manager.save(step, {"model": model, "opt_state": opt_state}, metrics={"loss": 0.25})
        ```
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ArgumentError(f"step must be a non-negative int, got {step!r}.")
        self._notices.listen(self)
        preempted = self._notices.reached(step)
        tiers = self._tiers.saving(step, force)
        if not (preempted or tiers):
            return False
        self._resume = None  # what latest_step chose is no longer the newest
        state = None if process_state is None else SavedState.of(process_state, process_count())  # now
        details = Details(metadata, metrics, progress, state)
        if preempted:
            return self._save_for_preemption(step, tree, details)
        with self._notices.saving(for_notice=False):
            for tier in tiers:  # in order: one that raises stops the others
                tier.save(step, tree, blocking=self.blocking, details=details)
        return True

    def _save_for_preemption(self, step: int, tree: PyTree, details: Details) -> bool:
        """Save ``step`` durably for a notice, then exit (or return); if it fails, the notice stands."""
        with self._notices.saving(for_notice=True):
            self._tiers.save_for_notice(step, tree, details)
        self._notices.saved_at = step
        if self.exit_on_preemption:
            print(f"eqxckpt: preemption notice; step {step} saved to {self.location}, exiting.", file=sys.stderr)
            raise SystemExit(0)
        return True

    def reached_preemption(self, step: int) -> bool:
        """Whether the job was told it will be stopped and ``step`` (the step just passed
        to `save`) was saved for it (with ``exit_on_preemption=False``; else `save` exits).

        **Returns:** True once `save` saved ``step`` because of a preemption notice.

        ```python
        for step in range(start, num_steps):
            if manager.save(step, state) and manager.reached_preemption(step):
                break
        ```
        """
        saved_at = self._notices.saved_at
        return saved_at is not None and step >= saved_at

    def wait(self) -> None:
        """Block until the saves in flight (and their retention) are done; raise their error.

        ```python
        manager.save(step, state)
        manager.wait()  # e.g. before the job ends
        ```
        """
        self._tiers.wait()

    def all_steps(self) -> list[int]:
        """Committed steps, ascending (a save still in flight is not among them).

        ```python
        manager.all_steps()  # [200, 300, 400]
        ```
        """
        return self._persistent.steps.committed()

    def latest_step(self) -> int | None:
        """The newest committed step, or None if there is none; a `load` without
        ``step`` restores it. With a local tier, the newest step every process can
        rebuild (from its own part or a peer's copy), if no older than the newest
        persistent step: collective, every process calls this.

        ```python
        start = manager.latest_step()
        state = manager.load(skeleton) if start is not None else init_state()
        ```
        """
        self._resume = resume = self._tiers.resumable().told()
        return resume.step

    def best_step(self) -> int | None:
        """The committed step with the best ``metrics[best_metric]``, or None.

        ```python
        model = manager.load(skeleton, step=manager.best_step(), at="model")
        ```
        """
        if self.best_metric is None:
            raise CheckpointError("best_step() needs CheckpointManager(best_metric=...).")
        return self._persistent.steps.best()

    def metrics(self, step: int) -> dict:
        """The metrics (``{name: float}``) saved with ``step``, a committed step.

        ```python
        manager.metrics(300)  # {'loss': 0.25}
        ```
        """
        return self._persistent.steps.metrics(step)

    def metadata(self, step: int | None = None) -> dict:
        """The ``metadata`` saved with ``step``, a persistent step (None: `all_steps()[-1]`).

        ```python
        manager.save(100, tree, metadata={"lr": 3e-4}), manager.wait()
        manager.metadata()["lr"]  # 0.0003
        ```
        """
        return self._persistent.steps.metadata(step)

    def load(
        self,
        like: PyTree | None = None,
        *,
        step: int | None = None,
        at: str | None = None,
        process_state: Any = None,
        from_process: int | None = None,
        **load_kwargs: Any,
    ) -> PyTree:
        """`eqxckpt.load` of ``step`` (default: the latest committed one).

        **Arguments:**

        - `like`, `at`, `load_kwargs` (``strict``, ``cast``...): as for `eqxckpt.load`.
        - `step`: a committed step, or None for the latest (the one `latest_step`
          just named; looked up again if another process's retention deletes it meanwhile).
        - `process_state`: an object with ``set_state()`` (the Grain iterator passed to
          `save`, made afresh): given this process's state saved with the step, from
          the same checkpoint the tree comes from.
        - `from_process`: whose state ``process_state`` takes: None (this process's,
          in a job of as many processes as saved the step; else an error), or a process
          index of the job that saved it (e.g. ``jax.process_index() % saved``).

        **Returns:** the restored pytree.

        ```python
        state = manager.load(eqx.filter_eval_shape(make_state))
        ```
        """
        resume, self._resume = self._resume, None
        if step is not None or resume is None:
            resume = self._tiers.resumable(step)
        if process_state is None and from_process is not None:
            raise ArgumentError("from_process says whose process_state to restore: pass process_state too.")
        states = None if process_state is None else StateRequest(process_state, from_process)
        return resume.restore(like, at, load_kwargs, states)

    def path(self, step: int) -> Any:
        """Where ``step`` is stored: what `eqxckpt.open`, `load` and `save` accept (a path,
        or a kvstore spec for object stores).

        ```python
        eqxckpt.verify(manager.path(manager.latest_step()))
        ```
        """
        return self._persistent.steps.step_path(step)

    def __enter__(self) -> "CheckpointManager":
        return self

    def close(self) -> None:
        """Wait for the save in flight (raising its error), and stop listening for
        preemption notices (as when garbage-collected; a later `save` listens again);
        what `with` does at the end of its block.

        ```python
        manager = eqxckpt.CheckpointManager("run")
        manager.close()
        ```
        """
        try:
            self._tiers.close()
        finally:
            self._notices.stop()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.location)!r}, steps={self.all_steps()})"
