"""`CheckpointManager`: a directory of numbered steps, retention, and resume."""

import collections
import contextlib
import math
import re
import signal
import sys
import threading
import warnings
import weakref
from typing import Any

import jax
from jaxtyping import PyTree

from ._background import SAVES, SaveHandle
from ._checkpoint import open_checkpoint
from ._errors import (
    CheckpointChangedError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    IncompleteCheckpointError,
)
from ._load import load
from ._preemption import Preemption
from ._progress import Progress
from ._save import save
from ._scalars import float_from_json, float_to_json
from ._storage import CheckpointPath, resolve
from ._store import is_storage_error

# The manager's own record in each checkpoint's metadata: the step and its metrics.
MANAGER_KEY = "eqxckpt.manager"

# A step is named by its number, written the one way str(int) writes it.
_STEP_NAME = re.compile(r"^(0|[1-9][0-9]*)$")


# How many times `CheckpointManager.load` looks for the latest step again when the one it
# picked was deleted meanwhile (each time a step that is gone).
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
    ):
        for name, value in (("max_to_keep", max_to_keep), ("keep_every", keep_every), ("keep_best", keep_best)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}.")
        if not isinstance(save_interval_steps, int) or save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be a positive int, got {save_interval_steps!r}.")
        if (
            not isinstance(preemption_grace_s, (int, float))
            or isinstance(preemption_grace_s, bool)
            or not 0 < preemption_grace_s < math.inf
        ):
            raise ValueError(f"preemption_grace_s must be a positive number of seconds, got {preemption_grace_s!r}.")
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}.")
        if keep_best is not None and best_metric is None:
            raise ValueError("keep_best needs best_metric: the name of the metric that ranks steps.")
        self.location = resolve(directory)
        self.max_to_keep = max_to_keep
        self.keep_every = keep_every
        self.save_interval_steps = save_interval_steps
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.keep_best = keep_best
        self.blocking = blocking
        self.incremental = incremental
        self._lock = threading.RLock()
        # Steps being loaded in this process, and steps retention dropped that
        # are not deleted yet: a step being read (here, or on a local disk by
        # any process) is deleted later, never from under its reader.
        self._readers: collections.Counter[int] = collections.Counter()
        self._doomed: set[int] = set()
        self._pending: SaveHandle | None = None
        self.exit_on_preemption = exit_on_preemption
        self._preemption_signals = preemption_signals if save_on_preemption else None
        self.preemption_grace_s = float(preemption_grace_s)
        # Listening from the first save until the manager is closed or collected (the
        # finalizer: a manager dropped unclosed must not keep the signal).
        self._preemption: Preemption | None = None
        self._stop_listening: weakref.finalize | None = None
        self._preempted_at: int | None = None
        if jax.process_index() == 0:
            self._clean_leftovers()
        # Committed steps -> metrics. Kept in memory and updated by the same
        # rule in every process, so step lists agree without communication.
        self._steps: dict[int, dict] = self._scan()

    # -- where things are -------------------------------------------------------------

    def _step_location(self, step: int) -> CheckpointPath:
        return self.location.sub(str(step)).user_path()

    def _scan(self, warn: bool = True) -> dict[int, dict]:
        """Committed steps and their metrics, as stored now.

        Entries that are not committed steps (a copy named ``007``, a damaged
        manifest, someone else's files) are skipped with one warning naming
        them; a step that disappears while it is read (another process's
        retention) is skipped silently. Steps whose checkpoint cannot be read
        (a damaged manifest) are remembered in ``_unreadable``: never saved over.
        """
        steps: dict[int, dict] = {}
        skipped: list[str] = []
        unreadable: dict[int, str] = {}
        for _ in range(3):
            steps, skipped, unreadable = {}, [], {}
            vanished = False
            for name, problem in self._entries():
                if problem is not None:
                    skipped.append(f"{name} ({problem})")
                    continue
                try:
                    steps[int(name)] = self._read_metrics(int(name))
                except (CheckpointNotFoundError, IncompleteCheckpointError, CheckpointChangedError):
                    vanished = True  # deleted meanwhile
                except CheckpointError as e:
                    unreadable[int(name)] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    skipped.append(f"{name} ({unreadable[int(name)]})")
            # A listing is no snapshot: a step committed and its predecessor deleted
            # while it ran can both be missed. Look again if anything moved.
            if steps and not vanished:
                break
        self._unreadable: dict[int, str] = unreadable  # steps holding a checkpoint that cannot be read -> why
        if skipped and warn:
            warnings.warn(
                f"CheckpointManager({str(self.location)!r}): skipped {len(skipped)} entries that are not committed "
                f"steps: {'; '.join(skipped[:20])}{' ...' if len(skipped) > 20 else ''}. Steps are directories "
                "named by their number (7, not 007) that hold a committed checkpoint.",
                stacklevel=3,
            )
        return steps

    def _entries(self) -> list[tuple[str, str | None]]:
        """(name, None) for each candidate step, (name, why not) for other entries."""
        out: list[tuple[str, str | None]] = []
        for name, state in self.location.entries():
            if state in ("busy", "retired") and _STEP_NAME.match(name):
                # A save or deletion in progress, or cleanup's to finish; or a deleted
                # step's arrays that newer steps still refer to (object stores).
                continue
            if not _STEP_NAME.match(name):
                out.append((name, "not a step number"))
            else:
                out.append((name, None if state == "committed" else "no committed checkpoint in it"))
        return out

    def _clean_leftovers(self) -> None:
        """Remove what interrupted saves and deletions of steps left, if provably abandoned and
        ours; nothing else (a copy named ``007``, a user's files) is touched."""
        left = self.location.clean_leftovers(lambda name: _STEP_NAME.match(name) is not None)
        if left:
            warnings.warn(
                f"CheckpointManager({str(self.location)!r}): left alone {len(left)} save prefixes that no lease or "
                f"manifest beside them explains: {', '.join(left[:20])}{' ...' if len(left) > 20 else ''}. A "
                "copy in progress or someone's files look like that; remove them yourself if they are not needed.",
                stacklevel=3,
            )

    def _read_metrics(self, step: int) -> dict:
        record = open_checkpoint(self._step_location(step)).metadata.get(MANAGER_KEY, {})
        metrics = record.get("metrics", {}) if isinstance(record, dict) else {}
        return {k: float_from_json(v) for k, v in metrics.items()} if isinstance(metrics, dict) else {}

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
            raise ValueError(f"step must be a non-negative int, got {step!r}.")
        if self._preemption is None and self._preemption_signals is not None:
            self._preemption = Preemption(self._preemption_signals, self.preemption_grace_s)
            self._stop_listening = weakref.finalize(self, self._preemption.close)
        # Asked at every step, by every process: with several, they agree on the step to save.
        preempted = self._preempted_at is None and self._preemption is not None and self._preemption.reached(step)
        if preempted:
            return self._save_for_preemption(step, tree, metadata, metrics, progress)
        if not (force or self.should_save(step)):
            return False
        # A notice's grace period does not end the process in the middle of this save.
        with self._preemption.saving(for_notice=False) if self._preemption else contextlib.nullcontext():
            self._start(step, tree, metadata, metrics, self.blocking, progress)
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
        """Save ``step`` (after the save in flight), then retention; in the background
        unless ``blocking``."""
        self.wait()
        if step in self._steps:
            raise CheckpointExistsError(
                f"Step {step} is already saved in {self.location}. Steps are saved once; resume from "
                f"latest_step() + 1, or delete the step first."
            )
        if step in self._unreadable:
            raise CheckpointExistsError(
                f"Step {step} of {self.location} holds a checkpoint that cannot be read "
                f"({self._unreadable[step]}); the manager never saves over it. Restore or delete "
                f"{self.location.sub(str(step))} yourself, then open the manager again."
            )
        metadata = dict(metadata or {})
        if MANAGER_KEY in metadata:
            raise CheckpointError(f"metadata key {MANAGER_KEY!r} is reserved for the manager's own record.")
        metrics = {str(k): float(v) for k, v in (metrics or {}).items()}
        metadata[MANAGER_KEY] = {"step": step, "metrics": {k: float_to_json(v) for k, v in metrics.items()}}
        # Never overwrite: a committed step is never replaced (another manager
        # that committed this step first makes this save fail instead).
        # Leaves unchanged since the latest step are taken from it, not written again
        # (unless the manager is not incremental).
        base = self._step_location(max(self._steps)) if self._steps and self.incremental else None
        handle = save(
            self._step_location(step), tree, metadata=metadata, blocking=blocking, progress=progress, base=base
        )
        if blocking:
            self._committed(step, metrics)
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
            self.wait()
            if step not in self._steps:
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
        self._committed(step, metrics)

    def _committed(self, step: int, metrics: dict) -> None:
        with self._lock:
            self._steps[step] = metrics
            doomed = set(self._steps) - self._kept()
            for old in doomed:
                del self._steps[old]
            self._doomed |= doomed
        self._delete_doomed()

    def _delete_doomed(self) -> None:
        """Delete the steps retention dropped, except those being read (later, then)."""
        if jax.process_index() != 0:
            return
        with self._lock:
            ready = sorted(s for s in self._doomed if not self._readers[s])
        for old in ready:
            try:
                deleted = self._delete(old)
            except (OSError, ValueError) as e:
                if isinstance(e, ValueError) and not is_storage_error(e):
                    raise
                raise CheckpointWriteError(
                    f"Deleting step {old} of {self.location} (retention) failed: {e}. The manager no longer "
                    "lists the step and tries again after its next save. Fix the cause (permissions, the store)."
                ) from e
            if deleted:
                with self._lock:
                    self._doomed.discard(old)

    def _kept(self) -> set[int]:
        steps = sorted(self._steps)
        if self.max_to_keep is None:
            return set(steps)
        kept = set(steps[-self.max_to_keep :])
        if self.keep_every is not None:
            kept |= {s for s in steps if s % self.keep_every == 0}
        if self.keep_best is not None:
            kept |= set(self._ranked()[: self.keep_best])
        return kept

    def _ranked(self) -> list[int]:
        """Steps with the best metric first (ties: the newer first); NaN ranks last."""
        sign = 1.0 if self.best_mode == "min" else -1.0

        def rank(step: int) -> tuple:
            value = self._steps[step][self.best_metric]
            return (math.isnan(value), 0.0 if math.isnan(value) else sign * value, -step)

        return sorted((s for s, m in self._steps.items() if self.best_metric in m), key=rank)

    def _delete(self, step: int) -> bool:
        """Uncommit, then remove, a step; False if it is being read (try again later)."""
        return self.location.sub(str(step)).delete()

    def wait(self) -> None:
        """Block until the save in flight (and its retention) is done; raise its error.

        ```python
        manager.save(step, state)
        manager.wait()  # e.g. before the job ends
        ```
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()
        if self._doomed:
            self._delete_doomed()

    # -- reading -----------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Committed steps, ascending (a save still in flight is not among them).

        **Returns:** a sorted list of ints.

        ```python
        manager.all_steps()  # [200, 300, 400]
        ```
        """
        with self._lock:
            return sorted(self._steps)

    def latest_step(self) -> int | None:
        """The newest committed step, or None if there is none.

        **Returns:** an int, or None.

        ```python
        start = manager.latest_step()
        state = manager.load(skeleton) if start is not None else init_state()
        ```
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The committed step with the best ``metrics[best_metric]``, or None.

        **Returns:** an int, or None when no step has that metric (or no `best_metric` is set).

        ```python
        model = manager.load(skeleton, step=manager.best_step(), at="model")
        ```
        """
        if self.best_metric is None:
            raise CheckpointError("best_step() needs CheckpointManager(best_metric=...).")
        with self._lock:
            ranked = self._ranked()
        return ranked[0] if ranked else None

    def metrics(self, step: int) -> dict:
        """The metrics saved with ``step``.

        **Arguments:**

        - `step`: a committed step.

        **Returns:** ``{name: float}``.

        ```python
        manager.metrics(300)  # {'loss': 0.25}
        ```
        """
        with self._lock:
            if step not in self._steps:
                raise CheckpointNotFoundError(
                    f"No committed step {step} in {self.location}; steps: {sorted(self._steps)}."
                )
            return dict(self._steps[step])

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
        metadata = dict(open_checkpoint(self._step_location(self._resolve_step(step))).metadata)
        metadata.pop(MANAGER_KEY, None)
        return metadata

    def _resolve_step(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(f"No committed checkpoint in {self.location} yet.")
        elif step not in self.all_steps():
            raise CheckpointNotFoundError(f"No committed step {step} in {self.location}; steps: {self.all_steps()}.")
        return step

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
        # The latest step may be deleted by another process (its retention) after
        # this manager listed it: then look again (one process only: several
        # must keep agreeing on their step lists). Each retry follows a step that
        # went away, which is never picked again, so a trainer that keeps saving
        # (and deleting) faster than this reads makes it retry, not fail.
        retries = 0 if step is not None or jax.process_count() > 1 else MAX_LATEST_ATTEMPTS - 1
        gone: set[int] = set()
        for _ in range(retries):
            try:
                return self._load_step(step, like, at, load_kwargs, gone)
            except (CheckpointChangedError, CheckpointNotFoundError, IncompleteCheckpointError):
                with self._lock:
                    self._steps = self._scan(warn=False)
        return self._load_step(step, like, at, load_kwargs, gone)

    def _load_step(self, step: int | None, like: Any, at: str | None, load_kwargs: dict, gone: set[int]) -> Any:
        with self._lock:  # pick the step and register as its reader in one go
            # A step found missing or being deleted may still be listed (on object
            # stores its files go one by one): do not pick it again.
            for step_gone in gone:
                self._steps.pop(step_gone, None)
            chosen = self._resolve_step(step)
            self._readers[chosen] += 1
        try:
            return load(self._step_location(chosen), like, at=at, **load_kwargs)
        except (CheckpointNotFoundError, IncompleteCheckpointError):
            gone.add(chosen)
            raise
        finally:
            with self._lock:
                self._readers[chosen] -= 1
            if chosen in self._doomed:
                self._delete_doomed()

    def path(self, step: int) -> Any:
        """Where ``step`` is stored (a path, or a kvstore spec for object stores).

        **Arguments:**

        - `step`: a step number.

        **Returns:** what `eqxckpt.open`, `load` and `save` accept for it.

        ```python
        eqxckpt.verify(manager.path(manager.latest_step()))
        ```
        """
        return self._step_location(step)

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
            if self._stop_listening is not None:
                self._stop_listening()  # Preemption.close, once
            self._preemption, self._stop_listening = None, None

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.location)!r}, steps={self.all_steps()})"
