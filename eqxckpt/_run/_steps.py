"""A run's steps: which entries of its directory are committed steps (`scan_steps`),
the run's identity (`read_run_id`), and `RunSteps`, the steps one manager knows, with
retention and reader-safe deletion."""

import collections
import contextlib
import dataclasses
import json
import re
import threading
import uuid
from collections.abc import Iterable, Iterator

import jax

from .._errors import (
    CheckpointChangedError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    IncompleteCheckpointError,
    ManifestError,
    warn_at_caller,
)
from .._manifest import parse_json_object
from .._paths import RUN_NAME
from .._read._checkpoint import open_checkpoint
from .._scalars import float_from_json, float_to_json
from .._storage import CheckpointPath, Storage
from .._stored import unwritten_at
from .._tensorstore import is_storage_error
from ._retention import Retention

# The manager's own record in each checkpoint's metadata: the step and its metrics.
MANAGER_KEY = "eqxckpt.manager"

# A step is named by its number, written the one way str(int) writes it.
_STEP_NAME = re.compile(r"0|[1-9][0-9]*")

# How many times a listing is taken again when steps came or went while it was taken.
SCAN_ATTEMPTS = 3

# Errors of a step that was deleted (or is being deleted) while it was read.
GONE = (CheckpointNotFoundError, IncompleteCheckpointError)


# The run's identity (docs/format.md, "The run's identity"): at most this many bytes, of
# exactly this shape. A new field comes with a new format number.
MAX_RUN_BYTES = 4096
RUN_FORMAT = 1
_RUN_ID = re.compile(r"[0-9a-f]{32}")
_RUN_EXPECTED = f'{{"run": "<32 lowercase hex digits>", "format": {RUN_FORMAT}}} in at most {MAX_RUN_BYTES} bytes'
_RUN_FIX = (
    "eqxckpt writes this file once, when a CheckpointManager first saves to the run, and never changes it: "
    "it ties the local tier's parts to this run. Restore it from a copy of the run; or delete it, and the next "
    "manager gives the run a new identity (local parts saved before are then not restored)."
)


def run_identity_bytes(run_id: str) -> bytes:
    """The bytes of the run identity file (`RUN_NAME`) for ``run_id`` (32 lowercase hex digits)."""
    return (json.dumps({"run": run_id, "format": RUN_FORMAT}) + "\n").encode()


def parse_run_identity(raw: bytes, where: str) -> str:
    """The run id that ``raw``, the bytes of a run's identity file, holds; hostile input.

    **Arguments:**

    - `raw`: what was read (at most `MAX_RUN_BYTES` + 1 bytes of it).
    - `where`: the file, for messages.

    **Returns:** the id, 32 lowercase hex digits. Raises `ManifestError` naming the file,
    what was expected and what was found, unless ``raw`` is exactly the JSON object
    `run_identity_bytes` writes (any whitespace).

    ```python
    parse_run_identity(b'{"run": "3f2c9a...", "format": 1}', "run/eqxckpt-run.json")  # '3f2c9a...'
    ```
    """
    if len(raw) > MAX_RUN_BYTES:
        raise _not_a_run_identity(where, f"holds more than {MAX_RUN_BYTES} bytes")
    try:
        doc = parse_json_object(raw, where, MAX_RUN_BYTES)  # duplicate keys, depth and non-JSON refused there
    except ManifestError as e:
        raise _not_a_run_identity(where, str(e).removeprefix(f"{where} ").rstrip(".")) from None
    if set(doc) != {"run", "format"}:
        raise _not_a_run_identity(where, f"holds the fields {sorted(doc)}")
    version, run_id = doc["format"], doc["run"]
    if type(version) is not int:
        raise _not_a_run_identity(where, f"names format {_shown(version)}")
    if version != RUN_FORMAT:
        raise _not_a_run_identity(
            where, f"names format {version}, which this eqxckpt does not know (a newer one wrote it: upgrade eqxckpt)"
        )
    if not isinstance(run_id, str) or _RUN_ID.fullmatch(run_id) is None:
        raise _not_a_run_identity(where, f"names the run {_shown(run_id)}")
    return run_id


def _shown(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _not_a_run_identity(where: str, found: str) -> ManifestError:
    return ManifestError(f"{where} {found}: expected a run's identity, {_RUN_EXPECTED}. {_RUN_FIX}")


def read_run_id(location: Storage, create: bool) -> str | None:
    """The identity of the run at ``location``, as its `RUN_NAME` file holds it.

    **Arguments:**

    - `location`: the run's directory.
    - `create`: if there is none, create it (a new random id); of processes racing to,
      one creates it and every one returns its id.

    **Returns:** 32 lowercase hex digits, or None if there is none and ``create`` is
    False. Raises `ManifestError` if the file is not one eqxckpt writes.

    ```python
    read_run_id(resolve("run"), create=True)  # '3f2c9a...', the same ever after
    ```
    """
    where = f"{str(location).rstrip('/')}/{RUN_NAME}"
    raw = _read_run_file(location, where)
    if raw is None and create:
        location.create_once(RUN_NAME, run_identity_bytes(uuid.uuid4().hex))
        raw = _read_run_file(location, where)  # the winner's, whoever created it
        if raw is None:
            raise CheckpointWriteError(
                f"{where} was created and is gone again: something is deleting {location} while a manager saves "
                "there. Stop it, then save again."
            )
    return None if raw is None else parse_run_identity(raw, where)


def _read_run_file(location: Storage, where: str) -> bytes | None:
    try:
        return location.read_small(RUN_NAME, MAX_RUN_BYTES)
    except OSError as e:
        raise _not_a_run_identity(
            where, f"cannot be read ({e.strerror or e}; a symlink, directory or special file is refused)"
        ) from None


def is_step_name(name: str) -> bool:
    """Whether ``name`` names a step: a number as `str(int)` writes it (``7``, not ``007``).

    **Arguments:**

    - `name`: an entry of a run's directory.

    **Returns:** True or False.

    ```python
    is_step_name("7"), is_step_name("007")  # (True, False)
    ```
    """
    return _STEP_NAME.fullmatch(name) is not None


def manager_record(step: int, metrics: dict[str, float], copy: int | None = None) -> dict:
    """What the manager stores under `MANAGER_KEY` in a step's metadata (metrics that
    are not finite written as JSON allows; ``copy``: which physical copy of the leaves
    it shares, `RunSteps.plan_copy`)."""
    record: dict = {"step": step, "metrics": {k: float_to_json(v) for k, v in metrics.items()}}
    if copy is not None:
        record["copy"] = copy
    return record


def step_metrics(location: Storage) -> dict[str, float]:
    """The metrics saved with the step at ``location`` (``{}`` if it has none).

    **Arguments:**

    - `location`: the step's storage.

    **Returns:** ``{name: float}``. Raises the `CheckpointError` of a step that cannot be opened.

    ```python
    step_metrics(resolve("run").sub("300"))  # {'loss': 0.25}
    ```
    """
    return step_record(location)[0]


def step_record(location: Storage) -> tuple[dict[str, float], int | None]:
    """The metrics saved with the step at ``location`` and which physical copy of its
    leaves it shares (`RunSteps.plan_copy`; None for a step saved without one). Raises
    the `CheckpointError` of a step that cannot be opened.

    ```python
    step_record(resolve("run").sub("300"))  # ({'loss': 0.25}, 1)
    ```
    """
    record = open_checkpoint(location).metadata.get(MANAGER_KEY, {})
    record = record if isinstance(record, dict) else {}
    metrics = record.get("metrics", {})
    copy = record.get("copy")
    return (
        {k: float_from_json(v) for k, v in metrics.items()} if isinstance(metrics, dict) else {},
        copy if isinstance(copy, int) and not isinstance(copy, bool) else None,
    )


@dataclasses.dataclass(frozen=True)
class StepScan:
    """What a run's directory holds, as `scan_steps` found it.

    **Attributes:**

    - `committed`: each committed step, with its metrics.
    - `unreadable`: each step whose checkpoint cannot be read (a damaged
      manifest), with why; never saved over.
    - `skipped`: ``"name (why)"`` for each entry that is not a committed step.
    - `copies`: for each committed step, which physical copy of the leaves it shares
      (`RunSteps.plan_copy`; None if saved without one).
    """

    committed: dict[int, dict[str, float]]
    unreadable: dict[int, str]
    skipped: list[str]
    copies: dict[int, int | None] = dataclasses.field(default_factory=dict)

    def warning(self, location: Storage) -> str | None:
        """The warning naming the skipped entries of ``location``, or None if none were.

        **Arguments:**

        - `location`: the run's directory.

        **Returns:** a message, or None.

        ```python
        message = scan_steps(location).warning(location)
        ```
        """
        if not self.skipped:
            return None
        return (
            f"CheckpointManager({str(location)!r}): skipped {len(self.skipped)} entries that are not committed "
            f"steps: {'; '.join(self.skipped[:20])}{' ...' if len(self.skipped) > 20 else ''}. Steps are "
            "directories named by their number (7, not 007) that hold a committed checkpoint."
        )


def scan_steps(location: Storage) -> StepScan:
    """The committed steps of the run at ``location`` and their metrics, as stored now.

    **Arguments:**

    - `location`: the run's directory.

    **Returns:** a `StepScan`. Entries that are not committed steps (a copy named
    ``007``, a damaged manifest, someone else's files) are in its ``skipped``;
    a step that disappears while it is read (another process's retention) is
    left out silently; a save or deletion in progress, or the arrays of a
    deleted step that newer steps still refer to, are left out silently too.

    ```python
    scan_steps(resolve("run")).committed  # {200: {'loss': 0.5}, 300: {'loss': 0.25}}
    ```
    """
    scan = StepScan({}, {}, [])
    for _ in range(SCAN_ATTEMPTS):
        scan = StepScan({}, {}, [])
        vanished = False
        for name, state in location.entries():
            if not is_step_name(name):
                scan.skipped.append(f"{name} (not a step number)")
            elif state in ("busy", "retired"):
                continue
            elif state != "committed":
                scan.skipped.append(f"{name} (no committed checkpoint in it)")
            else:
                try:
                    scan.committed[int(name)], scan.copies[int(name)] = step_record(location.sub(name))
                except (*GONE, CheckpointChangedError):
                    vanished = True  # deleted meanwhile
                except CheckpointError as e:
                    scan.unreadable[int(name)] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    scan.skipped.append(f"{name} ({scan.unreadable[int(name)]})")
        # A listing is no snapshot: a step committed and its predecessor deleted
        # while it ran can both be missed. Look again if anything moved.
        if scan.committed and not vanished:
            break
    return scan


def clean_leftovers(location: Storage) -> str | None:
    """Remove what interrupted saves and deletions of steps left in ``location``, if provably
    abandoned and eqxckpt's; nothing else (a copy named ``007``, a user's files) is touched.

    **Arguments:**

    - `location`: the run's directory.

    **Returns:** a warning naming what looked like eqxckpt's but was left alone, or None.

    ```python
    clean_leftovers(resolve("run"))  # None
    ```
    """
    left = location.clean_leftovers(is_step_name)
    if not left:
        return None
    return (
        f"CheckpointManager({str(location)!r}): left alone {len(left)} save prefixes that no lease or "
        f"manifest beside them explains: {', '.join(left[:20])}{' ...' if len(left) > 20 else ''}. A "
        "copy in progress or someone's files look like that; remove them yourself if they are not needed."
    )


class RunSteps:
    """The committed steps of a run as one manager knows them: retention, readers, deletion.

    Kept in memory and updated by the same rule in every process (a step is added
    when its save commits, and retention drops what it drops), so the processes'
    step lists agree without communication. A step retention dropped is deleted
    (by process 0) once no reader in this process holds it, never from under it;
    a deletion that finds it in use elsewhere is tried again later.

    **Arguments:**

    - `location`: the run's directory.
    - `retention`: the rule that says which steps to keep.
    - `scan`: what the directory holds now (`scan_steps`).

    ```python
    steps = RunSteps(location, Retention(max_to_keep=2), scan_steps(location))
    steps.committed()  # [200, 300]
    ```
    """

    def __init__(self, location: Storage, retention: Retention, scan: StepScan):
        self.location = location
        self.retention = retention
        self._lock = threading.RLock()
        self._metrics: dict[int, dict[str, float]] = dict(scan.committed)
        self._copies: dict[int, int | None] = dict(scan.copies)
        self._unreadable: dict[int, str] = dict(scan.unreadable)
        # Steps being read in this process, and steps retention dropped that are not deleted yet.
        self._readers: collections.Counter[int] = collections.Counter()
        self._doomed: set[int] = set()
        self._run_id: str | None = None  # read once (`run_id`), again after `rescan`
        self._run_lock = threading.Lock()  # not the steps' lock: no step waits on the storage's answer

    def step_path(self, step: int) -> CheckpointPath:
        """What `load`, `save` and `open` accept to name ``step`` (a path, or a kvstore spec)."""
        return self.location.sub(str(step)).user_path()

    def rescan(self) -> None:
        """Forget what is known and list the directory again (steps another process saved or
        deleted since); only where one process uses the list, as the others would not follow."""
        with self._lock:
            scan = scan_steps(self.location)
            self._metrics, self._unreadable, self._copies = scan.committed, scan.unreadable, dict(scan.copies)
        with self._run_lock:
            self._run_id = None  # the run may have been deleted and begun again

    def run_id(self, create: bool) -> str | None:
        """The identity of this run (`read_run_id`): read once, then kept until `rescan`.

        **Arguments:**

        - `create`: if the run has none yet, create it (call it before the run's first save
          to either tier; every process that races to gets the same id).

        **Returns:** 32 lowercase hex digits, or None if the run has none and ``create`` is
        False (not kept: asked again, the storage is read again). Raises `ManifestError`
        if the file is not one eqxckpt writes.

        ```python
        steps.run_id(create=True)  # '3f2c9a...': a local tier's parts belong to this run
        ```
        """
        with self._run_lock:
            if self._run_id is None:
                self._run_id = read_run_id(self.location, create)
            return self._run_id

    def committed(self) -> list[int]:
        """The committed steps, ascending."""
        with self._lock:
            return sorted(self._metrics)

    def metadata(self, step: int | None) -> dict:
        """The metadata saved with ``step`` (None: the latest), less the manager's own record."""
        metadata = dict(open_checkpoint(self.step_path(self.resolve(step))).metadata)
        metadata.pop(MANAGER_KEY, None)
        return metadata

    def metrics(self, step: int) -> dict[str, float]:
        """The metrics saved with ``step``; `CheckpointNotFoundError` if it is not committed."""
        with self._lock:
            return dict(self._metrics[self.resolve(step)])

    def best(self) -> int | None:
        """The committed step the retention's ``best_metric`` ranks first, or None."""
        with self._lock:
            ranked = self.retention.ranked(self._metrics)
        return ranked[0] if ranked else None

    def check_new(self, step: int) -> None:
        """Raise `CheckpointExistsError` unless ``step`` may be saved: it is not committed,
        and does not hold a checkpoint that cannot be read."""
        with self._lock:
            if step in self._metrics:
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

    def resolve(self, step: int | None, gone: Iterable[int] = ()) -> int:
        """``step`` if it is committed, or for None the newest committed step not in ``gone``.

        **Arguments:**

        - `step`: a step, or None for the latest.
        - `gone`: steps found deleted while listed: never picked again (on object
          stores a step's files go one by one, so it may still be listed).

        **Returns:** the step. Raises `CheckpointNotFoundError` if there is none.
        """
        with self._lock:
            for step_gone in gone:
                self._metrics.pop(step_gone, None)
            if step is None:
                if not self._metrics:
                    raise CheckpointNotFoundError(f"No committed checkpoint in {self.location} yet.")
                return max(self._metrics)
            if step not in self._metrics:
                raise CheckpointNotFoundError(
                    f"No committed step {step} in {self.location}; steps: {sorted(self._metrics)}."
                )
            return step

    @contextlib.contextmanager
    def reading(self, step: int | None, gone: Iterable[int] = ()) -> Iterator[int]:
        """Pick a step as `resolve` does and hold it as read (retention deletes it later).

        **Arguments:** as for `resolve`.

        **Returns:** a context manager giving the step.

        ```python
        with steps.reading(None) as step:
            tree = eqxckpt.load(steps.step_path(step))
        ```
        """
        with self._lock:  # pick the step and register as its reader in one go
            chosen = self.resolve(step, gone)
            self._readers[chosen] += 1
        try:
            yield chosen
        finally:
            with self._lock:
                self._readers[chosen] -= 1
                doomed = chosen in self._doomed
            if doomed:
                self.delete_doomed()

    def plan_copy(self, step: int, metrics: dict[str, float], copies: int) -> tuple[int | None, int | None]:
        """Which physical copy of its leaves a new ``step`` shares, and the step it shares
        them with (its incremental save's base; None: every leaf is written afresh).

        Steps are in ``copies`` groups, and a step shares leaves only with an earlier step
        of its own group: each group holds its own physical copy of every leaf. A new step
        joins a group that the steps kept with it (as retention will keep them, with
        ``metrics``) lack, while they span fewer than ``copies`` groups (or fewer than the
        kept steps); else the newest step's group. So once two or more steps are kept, no
        single copy of a leaf stands behind every kept step, and one damaged by a flipped
        bit has a twin to be mended from (`verify` with ``repair=True``). Steps saved
        without a group (by an older eqxckpt) count for none, as they may share any
        group's files: where the groups kept are too few even with the new step's, it
        shares nothing.

        **Arguments:**

        - `step`: the step to save.
        - `metrics`: its metrics (retention may keep it for them).
        - `copies`: how many physical copies the kept steps hold (1: every step shares
          with the newest).

        **Returns:** ``(group, base step or None)``; with ``copies=1`` the group is the
        newest step's, whose files it shares (None if that step has none).

        ```python
        steps.plan_copy(300, {}, copies=2)  # (1, 100): step 200 and 300 are in group 0
        ```
        """
        with self._lock:
            committed = sorted(self._metrics)
            if copies == 1:  # every step shares the newest's files: it is in that step's group
                return (self._copies.get(committed[-1]), committed[-1]) if committed else (0, None)
            kept = self.retention.kept({**self._metrics, step: metrics}) - {step}

            def group_of(s: int) -> int | None:
                # Steps saved without a group, or with one this manager does not make (another
                # tool's, or another setting's), count for none: they may link any group's files.
                found = self._copies.get(s)
                return found if found is not None and 0 <= found < copies else None

            held = {group_of(s) for s in kept} - {None}
            need = min(copies, len(kept) + 1)
            newest: dict[int, int] = {}  # each group's newest committed step
            for s in committed:
                if (group := group_of(s)) is not None:
                    newest[group] = s
            latest = group_of(committed[-1]) if committed else None
            if len(held) >= need and latest is not None:
                return latest, committed[-1]
            # A group the kept steps lack: the one with the newest step to share with.
            lacking = [g for g in range(copies) if g not in held] or list(range(copies))
            group = max(lacking, key=lambda g: (newest.get(g, -1), -g))
            if len(held) + 1 < need:
                return group, None  # even so too few copies: this step writes its own
            return group, newest.get(group)

    def add(self, step: int, metrics: dict[str, float], copy: int | None = None) -> None:
        """Record that ``step`` committed, with ``metrics`` (and its group of `plan_copy`),
        then apply retention (the steps it drops are deleted now, or once no reader here
        holds them)."""
        with self._lock:
            self._metrics[step] = metrics
            self._copies[step] = copy
            dropped = set(self._metrics) - self.retention.kept(self._metrics)
            for old in dropped:
                del self._metrics[old]
                self._copies.pop(old, None)
            self._doomed |= dropped
        self.delete_doomed()

    def delete_doomed(self) -> None:
        """Delete the steps retention dropped (process 0 only), except those being read;
        a step in use elsewhere is tried again after the next save."""
        if jax.process_index() != 0:
            return
        with self._lock:
            ready = sorted(s for s in self._doomed if not self._readers[s])
        for old in ready:
            where = self.location.sub(str(old))
            keep = unwritten_at(where)
            try:
                deleted = where.delete(keep)
            except (OSError, ValueError) as e:
                if isinstance(e, ValueError) and not is_storage_error(e):
                    raise
                raise CheckpointWriteError(
                    f"Deleting step {old} of {self.location} (retention) failed: {e}. The manager no longer "
                    "lists the step and tries again after its next save. Fix the cause (permissions, the store)."
                ) from e
            if deleted and keep:
                warn_at_caller(
                    f"Retention deleted step {old} of {self.location} but kept {len(keep)} files eqxckpt cannot show "
                    f"it wrote in it, as they were, in {where}.kept-<hex> beside it: {', '.join(keep[:10])}"
                    + (" ..." if len(keep) > 10 else "")
                    + ". Move them, and remove that directory.",
                )
            if deleted:
                with self._lock:
                    self._doomed.discard(old)
