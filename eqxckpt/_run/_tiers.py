"""The tiers of a `CheckpointManager` behind one seam: `Tier`, what the manager asks of
each; `PersistentTier` (the run's directory of steps) and `LocalFirstTier` (frequent
saves on each host, resumed from before the persistent tier); and `Resume`, the step the
tiers agreed to resume from, frozen from `latest_step` to the `load` that follows."""

import abc
import contextlib
import dataclasses
import os
from typing import Any

import jax
from jaxtyping import PyTree

from .._errors import ArgumentError, CheckpointChangedError, CheckpointError, CorruptCheckpointError, warn_at_caller
from .._formats._open import open as open_source
from .._local import LocalCheckpoints
from .._process_state import SavedState, give_back
from .._progress import Progress
from .._read._checkpoint import Checkpoint
from .._read._load import READ_ATTEMPTS, load
from .._read._read_once import failing_together, spans_processes
from .._read._source import Source
from .._storage import Storage
from .._write._background import SAVES, SaveHandle
from .._write._reuse import FULL_CHECK_INTERVAL_S, check_full_check_interval
from .._write._save import save
from ._retention import Retention
from ._steps import GONE, MANAGER_KEY, RunSteps, StepScan, clean_leftovers, manager_record, scan_steps

# How many steps `PersistentTier.restore` tries for the latest one when the one it picked
# was deleted or replaced meanwhile (each time a step that is gone is never picked again).
MAX_LATEST_ATTEMPTS = 32


@dataclasses.dataclass(frozen=True)
class Resume:
    """A step to resume from, as the tiers chose it: which tier restores it, the step
    (None: there is none), the tier's own choice, and the step `load` asked for (None:
    the latest). Frozen: `latest_step` keeps one for the `load` that follows."""

    tier: "Tier"
    step: int | None
    choice: Any
    asked: int | None
    named: bool = False  # `latest_step` told the user this step: only it may be restored

    def told(self) -> "Resume":
        """This resume, as `latest_step` named it to the user: `restore` then restores this
        step or raises, never another."""
        return dataclasses.replace(self, named=True)

    def restore(
        self, like: PyTree, at: str | None, load_kwargs: dict[str, Any], states: "StateRequest | None" = None
    ) -> PyTree:
        """Restore this step into ``like`` from its tier (every process, where the tier needs them).

        **Arguments:**

        - `like`, `at`, `load_kwargs`: as for `eqxckpt.load`.
        - `states`: where this process's saved state goes, read from the same checkpoint.

        **Returns:** the restored pytree.

        ```python
        state = tier.resumable().restore(like, None, {})
        ```
        """
        return self.tier.restore(self, like, at=at, states=states, **load_kwargs)


@dataclasses.dataclass(frozen=True)
class StateRequest:
    """A manager's load asking for this process's saved state (`_process_state`): given to
    ``target`` (``set_state``), read from the checkpoint the tree was restored from, as
    process ``from_process`` saved it (None: this process, in a job of as many)."""

    target: Any
    from_process: int | None = None

    def give(self, source: Source) -> None:
        """Give ``target`` the state from ``source`` (a checkpoint just restored from)."""
        if not isinstance(source, Checkpoint):
            raise CheckpointError(f"{source.location} is not an eqxckpt checkpoint: it holds no process_state.")
        give_back(self.target, source.process_state(self.from_process))


@dataclasses.dataclass(frozen=True)
class Details:
    """What a `CheckpointManager.save` gives with a step besides the tree (as it documents)."""

    metadata: dict[str, Any] | None = None
    metrics: dict[str, float] | None = None
    progress: Progress = "auto"
    process_state: SavedState | None = None


class Tier(abc.ABC):
    """What a `CheckpointManager` asks of each of its tiers."""

    @abc.abstractmethod
    def should_save(self, step: int) -> bool:
        """Whether this tier's interval saves ``step``."""

    @abc.abstractmethod
    def save(self, step: int, tree: PyTree, *, blocking: bool, details: Details | None = None) -> None:
        """Save ``tree`` as ``step``: what is saved is taken on the caller's thread, the
        rest happens in the background unless ``blocking``. Waits for this tier's save in
        flight first and raises its error. A tier keeps what it can use of ``details``."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Wait for this tier's save in flight; raise its error."""

    @abc.abstractmethod
    def resumable(self, step: int | None = None) -> Resume:
        """The step to resume from (``step``, or None for the newest), as every process
        agrees where this tier needs them all (then every process calls this)."""

    @abc.abstractmethod
    def restore(
        self,
        resume: Resume,
        like: PyTree,
        *,
        at: str | None = None,
        states: StateRequest | None = None,
        **load_kwargs: Any,
    ) -> PyTree:
        """Restore ``resume`` (one of this tier's) into ``like``, as `eqxckpt.load` does, and
        give ``states`` this process's state from the same checkpoint."""

    def close(self) -> None:
        """Wait for the saves in flight (raising their error) and let go of what it holds."""
        self.wait()


class PersistentTier(Tier):
    """The run's directory of numbered steps: saves (incremental, retention once each
    commits), and the one place a manager's load is retried.

    **Arguments:**

    - `location`: the run's directory.
    - `retention`: which steps to keep.
    - `scan`: what the directory holds now (`scan_steps`).
    - `interval`: save every this many steps.
    - `incremental`: share unchanged leaves with an earlier step.
    - `copies`: how many physical copies of each leaf the kept steps hold
      (`RunSteps.plan_copy`).

    ```python
    tier = PersistentTier(location, Retention(max_to_keep=2), scan_steps(location), interval=100, incremental=True)
    tier.save(100, state, blocking=True)
    ```
    """

    def __init__(
        self,
        location: Storage,
        retention: Retention,
        scan: StepScan,
        interval: int,
        incremental: bool,
        copies: int = 2,
        full_check_interval_s: float = FULL_CHECK_INTERVAL_S,
    ):
        self.steps = RunSteps(location, retention, scan)
        self.interval = interval
        self.incremental = incremental
        self.copies = copies
        self.full_check_interval_s = full_check_interval_s
        self._pending: SaveHandle | None = None

    @classmethod
    def opened(
        cls,
        location: Storage,
        retention: Retention,
        interval: int,
        incremental: bool,
        copies: int = 2,
        full_check_interval_s: float = FULL_CHECK_INTERVAL_S,
    ) -> "PersistentTier":
        """The run at ``location``, as a manager opens it: what interrupted saves left removed
        (process 0; only what is provably abandoned and eqxckpt's), its steps listed, and a
        warning naming entries that are not committed steps."""
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ArgumentError(f"save_interval_steps must be a positive int, got {interval!r}.")
        if not isinstance(copies, int) or isinstance(copies, bool) or copies < 1:
            raise ArgumentError(f"kept_copies must be a positive int, got {copies!r}.")
        check_full_check_interval(full_check_interval_s)
        if jax.process_index() == 0 and (left_alone := clean_leftovers(location)):
            warn_at_caller(left_alone)
        scan = scan_steps(location)
        if skipped := scan.warning(location):
            warn_at_caller(skipped)
        return cls(location, retention, scan, interval, incremental, copies, full_check_interval_s)

    def should_save(self, step: int) -> bool:
        return step % self.interval == 0

    def save(self, step: int, tree: PyTree, *, blocking: bool, details: Details | None = None) -> None:
        self.steps.check_new(step)  # refused before waiting for the save in flight
        self.wait()
        self.steps.check_new(step)
        details = details or Details()
        metadata = dict(details.metadata or {})
        if MANAGER_KEY in metadata:
            raise ArgumentError(f"metadata key {MANAGER_KEY!r} is reserved for the manager's own record.")
        metrics = {str(k): _metric(k, v) for k, v in (details.metrics or {}).items()}
        # Never overwrite: a committed step is never replaced (another manager that
        # committed this step first makes this save fail instead). Leaves unchanged since
        # an earlier step of the same copy are taken from it, not written again (unless
        # not incremental).
        copy, shared = self.steps.plan_copy(step, metrics, self.copies)
        metadata[MANAGER_KEY] = manager_record(step, metrics, copy)
        base = self.steps.step_path(shared) if shared is not None and self.incremental else None
        path = self.steps.step_path(step)
        handle = save(
            path,
            tree,
            metadata=metadata,
            blocking=blocking,
            progress=details.progress,
            base=base,
            full_check_interval_s=self.full_check_interval_s,
            process_state=details.process_state,
        )
        if blocking:
            self.steps.add(step, metrics, copy)
            return
        # Queued behind the save on the same single background thread, and tracked like
        # a save: the next save waits for it, its error is raised by wait(), by the next
        # save, or printed at exit.
        self._pending = SAVES.submit(handle.path, self._after_save, handle, step, metrics, copy)

    def _after_save(self, handle: SaveHandle, step: int, metrics: dict[str, float], copy: int | None) -> None:
        handle.wait()
        self.steps.add(step, metrics, copy)

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()
        self.steps.delete_doomed()

    def resumable(self, step: int | None = None) -> Resume:
        """``step``, or the newest committed step (read as the latest when restored).
        Every process lists the same steps: nothing is asked of the others."""
        committed = self.steps.committed()
        return Resume(self, committed[-1] if step is None and committed else step, step, step)

    def pinned(self, step: int | None, asked: int | None) -> Resume:
        """``step`` as chosen elsewhere (another tier, agreed by every process): read as
        that step (None: the latest), not looked up again. ``asked``: as for `Resume`."""
        return Resume(self, step, step, asked)

    def restore(
        self,
        resume: Resume,
        like: PyTree,
        *,
        at: str | None = None,
        states: StateRequest | None = None,
        **load_kwargs: Any,
    ) -> PyTree:
        # The one place a manager's load retries: it hands `load` an opened checkpoint, which
        # `load` reads once. A step replaced while read is read again; for the latest step,
        # one deleted by another process's retention is never picked again, and the steps
        # are listed again (one process only: several must keep agreeing on their step
        # lists), so a trainer that saves (and deletes) faster than this reads makes it
        # retry, not fail.
        step: int | None = resume.choice
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
                        chosen = held.enter_context(self.steps.reading(step, gone))
                    try:
                        with failing_together(together):
                            source = open_source(self.steps.step_path(chosen), format=source_format)
                        restored = load(source, like, at=at, **load_kwargs)
                        if states is not None:
                            with failing_together(together):
                                states.give(source)
                        return restored
                    except GONE:
                        gone.add(chosen)
                        raise
            except (CheckpointChangedError, *GONE) as e:
                # (Asked only after a change: a first restore's reads then overlap JAX's start-up.)
                last = attempt == attempts or jax.process_count() > 1
                if last or (step is not None and not isinstance(e, CheckpointChangedError)):
                    raise
            if step is None:
                self.steps.rescan()
        raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True)
class LocalSettings:
    """A manager's local tier: its directory on this host, its interval, how many peers
    keep a copy of each process's part, how many complete steps it keeps."""

    path: str | os.PathLike
    interval: int
    replicas: int
    keep: int


class LocalFirstTier(Tier):
    """The local tier (`LocalCheckpoints`), resumed from first: a process's own part,
    else a peer's copy of it, else (a `Resume` of) the persistent tier ``fallback``,
    as every process agrees.

    **Arguments:**

    - `settings`: the local tier's.
    - `fallback`: the run's persistent tier.

    ```python
    tier = LocalFirstTier(LocalSettings("/dev/shm/run", 10, 1, 1), persistent)
    state = tier.resumable().restore(like, None, {})
    ```
    """

    def __init__(self, settings: LocalSettings, fallback: PersistentTier):
        self.fallback = fallback
        self.local = LocalCheckpoints(
            settings.path, fallback.steps, settings.interval, settings.replicas, settings.keep
        )

    def should_save(self, step: int) -> bool:
        return self.local.should_save(step)

    def save(self, step: int, tree: PyTree, *, blocking: bool, details: Details | None = None) -> None:
        # Details are the persistent tier's (a local step is resumed from, never listed),
        # but for each process's own state.
        self.local.save(step, tree, blocking=blocking, process_state=details.process_state if details else None)

    def wait(self) -> None:
        self.local.wait()

    def close(self) -> None:
        self.local.close()  # and the lock on this host's directory

    def resumable(self, step: int | None = None) -> Resume:
        committed = self.fallback.steps.committed()
        if step is not None and step in committed:
            # Every process lists the same persistent steps, so every one goes there together.
            return self.fallback.resumable(step)
        choice, persistent = self.local.choose(committed[-1] if committed else None, step=step)
        if choice is None:
            return self.fallback.pinned(persistent if step is None else step, step)
        return Resume(self, choice.step, choice, step)

    def restore(
        self,
        resume: Resume,
        like: PyTree,
        *,
        at: str | None = None,
        states: StateRequest | None = None,
        **load_kwargs: Any,
    ) -> PyTree:
        options = load_kwargs if at is None else {"at": at, **load_kwargs}
        try:
            return self.local.restore(resume.choice, like, give=None if states is None else states.give, **options)
        except (CorruptCheckpointError, *GONE) as e:
            # The chosen parts were damaged in every copy, or deleted meanwhile (by hand): a
            # step `latest_step` named is never swapped for another; otherwise every process
            # chooses again (the damaged parts were set aside).
            if resume.named or resume.asked is not None:
                if isinstance(e, CorruptCheckpointError):
                    raise
                raise CheckpointChangedError(
                    f"The local tier's step {resume.step}, which latest_step() named, was deleted meanwhile "
                    f"(its parts: {e}). Call latest_step() again and resume from the step it names."
                ) from e
            again = self.resumable(resume.asked)
        return again.restore(like, at, load_kwargs, states)


def _metric(name: Any, value: Any) -> float:
    """A metric as the float the manager records, or an `ArgumentError` naming it."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ArgumentError(f"metric {name!r} must be a number, got {value!r}.") from None


class Tiers:
    """A manager's tiers, in the order it saves to them: the persistent tier first (a step
    it refuses is saved to no other, for a restart to resume from), then the local tier if
    ``local`` is given. Resumed from the last, which falls back on the first.

    ```python
    tiers = Tiers(persistent, LocalSettings("/dev/shm/run", 10, 1, 1))
    tiers.resumable().step
    ```
    """

    def __init__(self, persistent: PersistentTier, local: LocalSettings | None):
        self.persistent = persistent
        self.all: tuple[Tier, ...] = (persistent,) if local is None else (persistent, LocalFirstTier(local, persistent))

    def saving(self, step: int, force: bool) -> list[Tier]:
        """The tiers that save ``step`` (``force``: the persistent one whatever its interval)."""
        return [tier for tier in self.all if tier.should_save(step) or (force and tier is self.persistent)]

    def save_for_notice(self, step: int, tree: PyTree, details: Details) -> None:
        """Save ``step`` for a preemption notice: the fast copies first (a failure there is
        warned about), then durably in the persistent tier, unless it holds the step."""
        for fast in self.all[1:]:
            try:
                fast.save(step, tree, blocking=True, details=details)
            except CheckpointError as e:
                warn_at_caller(f"Preemption notice: the local tier's save of step {step} failed: {e}")
        self.persistent.wait()
        if step not in self.persistent.steps.committed():
            self.persistent.save(step, tree, blocking=True, details=details)

    def resumable(self, step: int | None = None) -> Resume:
        """What to resume from (`Tier.resumable` of the last tier)."""
        return self.all[-1].resumable(step)

    def wait(self) -> None:
        """Wait for every tier; the first error is raised."""
        with contextlib.ExitStack() as every:
            for tier in reversed(self.all):
                every.callback(tier.wait)

    def close(self) -> None:
        """Close every tier; the first error is raised."""
        with contextlib.ExitStack() as every:
            for tier in reversed(self.all):
                every.callback(tier.close)
