"""`CheckpointManager`: a directory of numbered steps, retention, and resume."""

import collections
import math
import os
import re
import shutil
import threading
from typing import Any

import jax

from ._checkpoint import open as open_checkpoint
from ._errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError
from ._load import load
from ._manifest import float_from_json, float_to_json
from ._paths import MANIFEST_NAME
from ._save import SaveHandle, _background, save, track
from ._store import delete_checkpoint, fsync_path, hidden_owner, hidden_sibling, is_array_key, resolve

# The manager's own record in each checkpoint's metadata: the step and its metrics.
MANAGER_KEY = "eqxckpt.manager"

_STEP_MANIFEST = re.compile(r"^(\d+)/" + re.escape(MANIFEST_NAME) + "$")


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

    Opening a directory cleans up what interrupted saves left behind (process 0
    only); such leftovers are never listed or loaded.

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
        directory: Any,
        *,
        max_to_keep: int | None = None,
        keep_every: int | None = None,
        save_interval_steps: int = 1,
        best_metric: str | None = None,
        best_mode: str = "min",
        keep_best: int | None = None,
        blocking: bool = False,
    ):
        for name, value in (("max_to_keep", max_to_keep), ("keep_every", keep_every), ("keep_best", keep_best)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}.")
        if not isinstance(save_interval_steps, int) or save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be a positive int, got {save_interval_steps!r}.")
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
        self._lock = threading.RLock()
        # Steps being loaded in this process, and doomed steps whose deletion
        # waits for those loads: retention never pulls data from under a reader.
        self._readers: collections.Counter[int] = collections.Counter()
        self._deferred: set[int] = set()
        self._pending: SaveHandle | None = None
        if jax.process_index() == 0:
            self._clean_leftovers()
        # Committed steps -> metrics. Kept in memory and updated by the same
        # rule in every process, so step lists agree without communication.
        self._steps: dict[int, dict] = {step: self._read_metrics(step) for step in self._list_committed()}

    # -- where things are -------------------------------------------------------------

    def _step_location(self, step: int) -> Any:
        if self.location.local is not None:
            return self.location.local / str(step)
        return self.location.child(str(step))

    def _list_committed(self) -> list[int]:
        local = self.location.local
        if local is not None:
            if not local.is_dir():
                return []
            return sorted(int(p.name) for p in local.iterdir() if p.name.isdigit() and (p / MANIFEST_NAME).is_file())
        keys = (k.decode("utf-8", "replace") for k in self.location.open_kvstore().list().result())
        return sorted(int(m.group(1)) for k in keys if (m := _STEP_MANIFEST.match(k)))

    def _clean_leftovers(self) -> None:
        """Remove what interrupted saves and deletions left; never anything else."""
        local = self.location.local
        if local is not None:
            if local.is_dir():
                for entry in local.iterdir():
                    owner = hidden_owner(entry.name)
                    if owner is not None and owner.isdigit() and entry.is_dir():
                        shutil.rmtree(entry, ignore_errors=True)
            return
        store = self.location.open_kvstore()
        by_step: dict[str, list[bytes]] = {}
        for key in store.list().result():
            head, sep, rest = key.decode("utf-8", "replace").partition("/")
            if sep and head.isdigit():
                by_step.setdefault(head, []).append(rest.encode())
        for head, keys in by_step.items():
            uncommitted = MANIFEST_NAME.encode() not in keys
            if uncommitted and all(is_array_key(k) for k in keys):
                delete_checkpoint(store, head + "/")

    def _read_metrics(self, step: int) -> dict:
        record = open_checkpoint(self._step_location(step)).metadata.get(MANAGER_KEY, {})
        metrics = record.get("metrics", {}) if isinstance(record, dict) else {}
        return {k: float_from_json(v) for k, v in metrics.items()} if isinstance(metrics, dict) else {}

    # -- saving ------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether `save` would save ``step`` without ``force``."""
        return step % self.save_interval_steps == 0

    def save(
        self, step: int, tree: Any, *, metadata: dict | None = None, metrics: dict | None = None, force: bool = False
    ) -> bool:
        """Save ``tree`` as step ``step`` (in the background unless ``blocking``).

        Returns False, saving nothing, for a step the interval excludes (unless
        ``force``). Waits for the previous save first and raises its error, if
        any. Retention runs once this save has committed.

        ```python
        manager.save(step, {"model": model, "opt_state": opt_state}, metrics={"loss": 0.25})
        ```
        """
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}.")
        if not (force or self.should_save(step)):
            return False
        self.wait()
        if step in self._steps:
            raise CheckpointExistsError(
                f"Step {step} is already saved in {self.location}. Steps are saved once; resume from "
                f"latest_step() + 1, or delete the step first."
            )
        metadata = dict(metadata or {})
        if MANAGER_KEY in metadata:
            raise CheckpointError(f"metadata key {MANAGER_KEY!r} is reserved for the manager's own record.")
        metrics = {str(k): float(v) for k, v in (metrics or {}).items()}
        metadata[MANAGER_KEY] = {"step": step, "metrics": {k: float_to_json(v) for k, v in metrics.items()}}
        # overwrite=True only ever meets leftovers of an interrupted save of this
        # step: committed steps are refused above.
        handle = save(self._step_location(step), tree, metadata=metadata, blocking=self.blocking, overwrite=True)
        if self.blocking:
            self._committed(step, metrics)
            return True
        # Queued behind the save on the same single background thread, and
        # tracked like a save: the next save waits for it, its error is raised
        # by wait(), by the next save, or printed at exit.
        self._pending = track(handle.path, _background().submit(self._after_save, handle, step, metrics))
        return True

    def _after_save(self, handle, step: int, metrics: dict) -> None:
        handle.wait()
        self._committed(step, metrics)

    def _committed(self, step: int, metrics: dict) -> None:
        with self._lock:
            self._steps[step] = metrics
            doomed = sorted(set(self._steps) - self._kept())
            for old in doomed:
                del self._steps[old]
            self._deferred.update(old for old in doomed if self._readers[old])
            doomed = [old for old in doomed if not self._readers[old]]
        if jax.process_index() == 0:
            for old in doomed:
                self._delete(old)

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

    def _delete(self, step: int) -> None:
        """Uncommit first (rename away / drop the manifest), then remove the data."""
        local = self.location.local
        if local is not None:
            aside = hidden_sibling(local / str(step), "deleting")
            os.rename(local / str(step), aside)
            fsync_path(local)
            shutil.rmtree(aside, ignore_errors=True)
            return
        delete_checkpoint(self.location.open_kvstore(), f"{step}/")

    def wait(self) -> None:
        """Block until the save in flight (and its retention) is done; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    # -- reading -----------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Committed steps, ascending (a save still in flight is not among them)."""
        with self._lock:
            return sorted(self._steps)

    def latest_step(self) -> int | None:
        """The newest committed step, or None if there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self) -> int | None:
        """The committed step with the best ``metrics[best_metric]``, or None."""
        if self.best_metric is None:
            raise CheckpointError("best_step() needs CheckpointManager(best_metric=...).")
        with self._lock:
            ranked = self._ranked()
        return ranked[0] if ranked else None

    def metrics(self, step: int) -> dict:
        """The metrics saved with ``step``."""
        with self._lock:
            if step not in self._steps:
                raise CheckpointNotFoundError(f"No committed step {step} in {self.location}; steps: {sorted(self._steps)}.")
            return dict(self._steps[step])

    def metadata(self, step: int | None = None) -> dict:
        """The metadata saved with ``step`` (default: the latest)."""
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

    def load(self, like: Any = None, *, step: int | None = None, at: str | None = None, **load_kwargs: Any) -> Any:
        """`eqxckpt.load` of ``step`` (default: the latest committed one).

        ```python
        state = manager.load(eqx.filter_eval_shape(make_state))
        ```
        """
        with self._lock:  # pick the step and register as its reader in one go
            step = self._resolve_step(step)
            self._readers[step] += 1
        try:
            return load(self._step_location(step), like, at=at, **load_kwargs)
        finally:
            with self._lock:
                self._readers[step] -= 1
                delete_now = step in self._deferred and not self._readers[step]
                if delete_now:
                    self._deferred.discard(step)
            if delete_now and jax.process_index() == 0:
                self._delete(step)

    def path(self, step: int) -> Any:
        """Where ``step`` is stored (a path, or a kvstore spec for object stores)."""
        return self._step_location(step)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wait()

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.location)!r}, steps={self.all_steps()})"
