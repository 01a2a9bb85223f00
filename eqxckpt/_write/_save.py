"""`save`: write a pytree as per-leaf zarr3 arrays plus a manifest, atomically."""

import concurrent.futures
import contextlib
import dataclasses
import json
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
from jaxtyping import PyTree

from .._arguments import checked_arguments
from .._chunks import encode
from .._distributed import Phases, is_multiprocess, process_count, process_index
from .._errors import ArgumentError, CheckpointError, CheckpointWriteError, UnsupportedLeafError, warn_at_caller
from .._gc import collector_paused
from .._interrupts import interrupts_deferred
from .._leaf import Leaf, StoredLeaf
from .._manifest import Manifest, metadata_bytes
from .._monitoring import SAVE_BLOCKED, SAVE_BYTES, SAVE_COMMITTED, record_bytes, record_duration
from .._paths import GROUP_METADATA, group_file, group_locations, key_entry
from .._process_state import OwnState, ProcessStates, SavedState, state_limit
from .._progress import Progress, advance, reporting, unless_background
from .._storage import (
    NOTHING_COMMITTED,
    CheckpointPath,
    Staging,
    Storage,
    expected_files,
    nothing_committed,
    resolve,
)
from .._stored import unwritten_at
from .._tensorstore import is_storage_error, reason
from .._tree import flatten
from .._window import Task, read_window, run_windowed
from ._background import SAVES, SaveHandle
from ._jobs import Hashing, WriteJob, digested
from ._pack import PACK_MIN_LEAVES, PackedArray, assign_offsets, packable
from ._pieces import PackedWrite, Piece, record_of, snapshot
from ._reuse import FULL_CHECK_INTERVAL_S, Reuse, check_full_check_interval, plan_reuse
from ._shares import check_copies_agree, copy_digests, global_leaves


def _plan(tree: PyTree) -> tuple[list[Leaf], list[tuple[StoredLeaf, Any]]]:
    """Every leaf's manifest record, and the arrays to write (``LazyArray`` leaves
    are copied from their checkpoint)."""
    flat, _ = flatten(tree, empty_in_sequences=True)
    records: list[Leaf] = []
    arrays: list[tuple[StoredLeaf, Any]] = []
    for path, keypath, value in flat:
        if not path:
            raise ArgumentError(
                "save needs a container at the top of the tree (a module, dict, list...); "
                "wrap a single array, e.g. save(path, {'x': array})."
            )
        keys = tuple(key_entry(e)[0] for e in keypath)
        record, data = record_of(path, keys, value)
        records.append(record)
        if isinstance(record, StoredLeaf):
            arrays.append((record, data))
    return records, arrays


def _jobs(planned: list[tuple[StoredLeaf, tuple[int, ...] | None, list[Piece]]]) -> list[WriteJob]:
    """The jobs of what `_pieces.snapshot` planned (the pieces this process must write, in
    host memory it owns), each layout checked as a load would check it."""
    jobs = [WriteJob(record, shard, pieces) for record, shard, pieces in planned]
    for job in jobs:  # in every process alike, before any is written
        if why := job.layout.refusal():
            record = job.record
            raise UnsupportedLeafError(
                f"Leaf {record.path!r} ({record.dtype}{list(record.data_shape)}"
                + ("" if job.shard is None else f", in shards of {list(job.shard)}")
                + f"): its array {why}, which a load refuses, so it is not saved. Give each shard a length "
                "with a divisor near 64 MiB's worth of its rows (pad it, e.g. to a multiple of 8), or shard it "
                "along another dimension."
            )
    return jobs


def _pack(records: list[Leaf], leaves: list[WriteJob]) -> tuple[list[Leaf], list[WriteJob]]:
    """Small leaves written whole from host memory go into the packed array (see `_pack`)
    when there are enough of them to be worth it; the records say where each one is."""
    small = [
        leaf
        for leaf in leaves
        if leaf.shard is None and len(leaf.pieces) == 1 and leaf.pieces[0].whole is not None and packable(leaf.record)
    ]
    if len(small) < PACK_MIN_LEAVES:
        return records, leaves
    placed = assign_offsets([leaf.record for leaf in small])
    where = {id(leaf.record): record for leaf, record in zip(small, placed)}
    packing = PackedArray(placed)
    written = PackedWrite(
        packing,
        {record.path: whole for leaf, record in zip(small, placed) if (whole := leaf.pieces[0].whole) is not None},
    )
    chosen = {id(leaf) for leaf in small}
    return (
        [where.get(id(record), record) for record in records],
        [leaf for leaf in leaves if id(leaf) not in chosen] + [WriteJob(packing.record, None, [written])],
    )


def _write(target: Storage, leaves: list[WriteJob], *, metadata: bool, chunks: bool) -> None:
    """Write each leaf's ``zarr.json`` (``metadata``) and its pieces' chunks (``chunks``),
    all through one window: a chunk's values are produced (a view of host memory, a packed
    chunk assembled, a copied chunk read) on an I/O thread just before it is written.

    Views reference the source buffers rather than copy them: nothing changes them while
    we wait, since jax arrays are immutable, an async save copied its numpy leaves, and
    a blocking save returns only afterwards. Nothing is still writing when this returns
    or raises, so a failed save can remove its files."""
    files = target.chunk_files()

    def written(
        record: StoredLeaf, key: str, produce: Callable[[], list[np.ndarray]]
    ) -> Callable[[], Coroutine[Any, Any, None]]:
        async def work() -> None:
            try:
                await files.writing(f"{record.path}/{key}", produce())
            except CheckpointError:
                raise
            except Exception as e:
                why = reason(e) or type(e).__name__
                error = CheckpointWriteError(f"Writing leaf {record.path!r} failed: {why}. {nothing_committed(why)}")
                error.errno = getattr(e, "errno", None)
                raise error from e

        return work

    tasks: list[Task] = []
    for leaf in leaves if metadata else []:
        doc = np.frombuffer(leaf.layout.zarr_json(), np.uint8)
        tasks.append((0, written(leaf.record, "zarr.json", lambda doc=doc: [doc]), None))
    for leaf in leaves if chunks else []:
        layout = leaf.layout
        for piece in leaf.pieces:
            for key, part, values, done in piece.chunks(layout):
                nbytes = math.prod(s.stop - s.start for s in part) * layout.dtype.itemsize
                produce = lambda layout=layout, part=part, values=values: encode(layout, part, values())  # noqa: E731
                report = lambda _, nbytes=nbytes, done=done: advance(nbytes, done)  # noqa: E731
                tasks.append((nbytes, written(leaf.record, key, produce), report))
    run_windowed(tasks, read_window(sum(nbytes for nbytes, _, _ in tasks)))


class SaveInProgress:
    """One save, from claiming its place to its commit, in three steps: `prepare` (process
    0), `write` (every process), `commit` (process 0). `run` takes them in turn, each a
    phase that ends at a barrier when several processes save together (`_distributed`).

    **Arguments:**

    - `location`: where the checkpoint goes.
    - `manifest`: what it commits, with its leaves' digests.
    - `reuse`: what process 0 takes from a base (`plan_reuse`; elsewhere nothing), and
      the jobs written.
    - `overwrite`: whether a checkpoint there is replaced.
    - `phases`: the phases of a multi-process save; None with one process.
    - `hashing`: where the digests are still being computed (`manifest` then has none):
      waited for before the commit.

    ```python
    SaveInProgress(location, manifest, reuse, overwrite=False, phases=None).run()
    ```
    """

    def __init__(
        self,
        location: Storage,
        manifest: Manifest,
        reuse: Reuse[WriteJob],
        overwrite: bool,
        phases: Phases | None,
        hashing: Hashing | None = None,
        durable: bool = True,
        own_state: OwnState | None = None,
    ):
        self.location = location
        self.own_state = own_state
        self.process_states: ProcessStates | None = None
        self.durable = durable
        self.manifest = manifest
        self.hashing = hashing
        self.reuse = reuse
        self.overwrite = overwrite
        self.phases = phases
        self.leader = phases is None or phases.rank == 0
        self.writing = list(reuse.written)  # and referred leaves whose prefix cannot be held
        self.staging: Staging | None = None
        self.committed = False
        self.copies: list[str] = []  # each process's `write` result: digests of shared copies

    def prepare(self) -> str | None:
        """Process 0: claim the place, take the leaves reused from the base (held prefixes,
        linked files), and create the zarr groups and every array written.

        **Returns:** where the other processes write (`Staging.where`); None elsewhere.

        ```python
        where = saving.prepare()
        ```
        """
        if not self.leader:
            return None
        linked = [job for job, _, _ in self.reuse.linked]
        everything = [*self.writing, *linked, *(job for job, _, _ in self.reuse.referred)]
        self.staging = staging = self.location.begin_save([job.record.path for job in everything], self.overwrite)
        if self.overwrite:  # what another tool put in the checkpoint replaced stays (`Storage.delete`)
            staging.unwritten = unwritten_at
        self.manifest, unheld = self.reuse.refer_from(staging, self.manifest)
        self.writing.extend(unheld)  # doomed meanwhile: written
        # The directories above the arrays become zarr groups, written while the arrays are created.
        store = staging.storage.open_kvstore()
        own = [job.record.path for job in [*self.writing, *linked]]
        groups = [store.write(group_file(g), GROUP_METADATA) for g in group_locations(own)]
        self.manifest = self.reuse.link_into(staging, self.manifest)
        try:  # every process then writes its chunks into these arrays
            _write(staging.storage, self.writing, metadata=True, chunks=False)
        finally:  # nothing may still be writing when a failed save removes its files
            failures = [written.exception() for written in groups]  # (Ctrl-C is held back here)
        for failure in failures:
            if failure is not None:
                raise failure
        return staging.where

    def write(self, where: str) -> str:
        """Every process: write its pieces' chunks into the arrays `prepare` made, and make
        them durable.

        **Arguments:**

        - `where`: what `prepare` returned on process 0.

        **Returns:** the digests of this process's copies of parts other processes write
        from too (`_shares.copy_digests`), which the commit compares.

        ```python
        saving.write(where)
        ```
        """
        if self.staging is None:
            self.staging = self.location.join_save(where)
        with contextlib.ExitStack() as sources:
            # Leaves copied from other checkpoints: those must stay the same until written.
            copied = {id(p.source): p.source for job in self.writing for p in job.pieces if p.source is not None}
            for source in copied.values():
                sources.enter_context(source.consistent())
            _write(self.staging.storage, self.writing, metadata=False, chunks=True)
        if self.durable:
            self.staging.sync()
        copies = [(job.record, *copy) for job in self.writing for piece in job.pieces if (copy := piece.shared_copy())]
        if not copies:
            return ""
        known: dict[str, str] = {}
        if self.leader:  # process 0 hashed the leaves it holds whole for the manifest
            if self.hashing is not None:
                self.manifest = self.hashing.result()
            known = {r.path: r.digest for r in self.manifest.leaves if isinstance(r, StoredLeaf) and r.digest}
        return copy_digests(copies, known)

    def commit(self) -> None:
        """Process 0, once every process has written: check every file is there, then commit
        the manifest.

        ```python
        saving.commit()
        ```
        """
        if self.leader and self.staging is not None:
            check_copies_agree(self.copies)
            if self.hashing is not None:
                self.manifest = self.hashing.result()
            if self.process_states is not None:
                self.manifest = dataclasses.replace(self.manifest, process_states=self.process_states)
            jobs = [*self.writing, *(job for job, _, _ in self.reuse.linked)]
            self.staging.commit(self.manifest, expected_files([(job.record, job.layout) for job in jobs]))
            self.committed = True
            if (kept := self.staging.kept_at) is not None:
                warn_at_caller(
                    f"Saving over {self.location} left {len(self.staging.keep_replaced)} files eqxckpt cannot show it wrote "
                    f"in the checkpoint it replaced where they were, now in {kept}: "
                    f"{', '.join(self.staging.keep_replaced[:10])}. Move them, and remove that directory.",
                )

    def _after_commit(self) -> str:
        """What a save whose processes did not all reach the end of the commit left."""
        if self.committed:
            return (
                f"This process committed {self.location} (complete: every process had written its part), but "
                "the others did not hear so in time and raise: check it with eqxckpt.open before saving it again."
            )
        return (
            f"Process 0 may have committed {self.location} meanwhile (complete: every process had written its "
            "part), or not: check with eqxckpt.open before saving it again."
        )

    def run(self) -> None:
        """Prepare, write, commit. A failure removes what this save wrote and is raised as a
        `CheckpointWriteError` where it was the storage's.

        ```python
        saving.run()
        ```
        """
        phase = self.phases.run if self.phases is not None else (lambda _, work: [work()])
        try:
            # Ctrl-C waits while a staging directory is made and recorded, or committed:
            # interrupted there, one would be left behind half made. Writes stay interruptible.
            with interrupts_deferred():
                [where, *_] = phase("prepare", self.prepare)
            # Each process's own state comes to process 0 with what it wrote, for the commit.
            own = None if self.own_state is None else self.own_state.to_json()
            written = [json.loads(r) for r in phase("write", lambda: json.dumps([self.write(where or ""), own]))]
            self.copies = [copies for copies, _ in written]
            self.process_states = OwnState.gathered([state for _, state in written])
            with interrupts_deferred():
                if self.phases is None:
                    self.commit()
                else:  # process 0 may commit and then wait in vain: the error must not deny it
                    self.phases.run("commit", self.commit, self._after_commit)
        except BaseException as e:
            if self.staging is not None:
                with interrupts_deferred():
                    self.staging.abort(e)
            if isinstance(e, OSError) and not isinstance(e, CheckpointError):
                error = CheckpointWriteError(f"Saving to {self.location} failed: {e}. {NOTHING_COMMITTED}")
                error.errno = e.errno
                raise error from e
            if is_storage_error(e):
                why = reason(e)
                raise CheckpointWriteError(f"Saving to {self.location} failed: {why}. {nothing_committed(why)}") from e
            raise
        finally:
            if self.staging is not None:
                self.staging.release()


@checked_arguments
def save(
    path: CheckpointPath,
    tree: PyTree,
    *,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    blocking: bool = True,
    progress: Progress = "auto",
    base: CheckpointPath | None = None,
    full_check_interval_s: float = FULL_CHECK_INTERVAL_S,
    process_state: Any = None,
) -> SaveHandle:
    """Save a pytree as a checkpoint directory: one zarr3 array per array leaf.

    **Arguments:**

    - `path`: a local directory, a ``file://``/``memory://``/``s3://``/``gs://`` URL,
      or a TensorStore kvstore spec dict (e.g. an S3 endpoint and credentials).
    - `tree`: any pytree (Equinox modules, optax states, dicts, lists...). Array
      leaves are stored at their key path (``model/layers/0/weight``), little-endian
      whatever their byte order (a big-endian numpy array loads as the same values,
      native); Python scalars and strings go into the manifest; other leaves
      (functions) are recorded by type and restored from ``like`` on load.
    - `metadata`: a JSON-serialisable dict stored with the checkpoint.
    - `overwrite`: replace an existing checkpoint (atomically on local disks).
    - `blocking`: if False, return as soon as the arrays are in host memory
      (device arrays copied, CPU arrays held, numpy arrays copied), and write,
      sync and commit in the background. The checkpoint is independent of
      what the caller does next (donating, deleting or mutating the arrays
      included). Errors surface on ``handle.wait()``, on the next `save`, or
      at interpreter exit.
    - `progress`: ``"auto"`` (the default) shows a progress bar (bytes and
      leaves, rate, time left) on stderr when it is a terminal, for a save the
      caller waits on of at least 1 GiB or still running after 2 s, on process
      0 only (never for a background save); True shows it for any save on a
      terminal; False never. A callable receives ``(done_bytes, total_bytes,
      done_leaves, total_leaves)`` after each leaf, wherever output goes.
    - `base`: an earlier checkpoint (`CheckpointManager` passes its latest
      step). A leaf whose digest, dtype and shape equal ``base``'s leaf at the
      same path is not written again, once its bytes in ``base`` pass every
      check `verify` makes (each chunk's CRC-32C, the leaf's digest): a
      damaged one is written from the values being saved, with a warning
      naming it, so damage in ``base`` never spreads. On a local disk
      (``base`` on the same disk) it is hard-linked from ``base`` (copied
      where links are refused): the new checkpoint is complete on its own,
      and deleting ``base`` later leaves it whole. On an object store (``base`` beside ``path``, in the
      same directory) the manifest refers to ``base``'s copy, which eqxckpt's
      deletions then keep while any checkpoint refers to it (see the format
      specification). Ignored otherwise. Leaves whose shards several
      processes write are written in full, and packed small leaves are
      taken only all together, when none of them changed.
    - `full_check_interval_s`: a leaf ``base`` shares that was read and
      checked whole less than this many seconds ago (and fewer than 100
      saves ago) is shared without reading it again while each of its files
      or objects is unchanged since then (on a local disk their stamps, one
      ``lstat`` each; on an object store their generations, one metadata
      request each; the threat model says what this trusts). 0: every leaf
      shared is read and checked.
    - `process_state`: this process's own small state, saved with the
      checkpoint and committed with it: bytes, a JSON value, or an object
      with ``get_state()`` (a Grain iterator), whose state is taken now, on
      the caller's thread. With several processes each passes its own; each
      reads its own back with `Checkpoint.process_state` (the manager's
      `load` gives it back). At most 64 KiB of JSON a process.

    With several JAX processes (``jax.process_count() > 1``) every process
    calls `save` with the same tree of global arrays; each writes only shards
    it holds (the chunks of a shard several processes hold are divided among
    them, so each writes its share of replicated data), and process 0 commits
    once all have finished.

    **Returns:** a `SaveHandle` (already finished when ``blocking=True``).

    ```python
    model = eqx.nn.MLP(2, 2, 8, 2, key=jax.random.key(0))
    eqxckpt.save("checkpoints/step_0", {"model": model}, metadata={"step": 0})
    handle = eqxckpt.save("checkpoints/step_1", {"model": model}, blocking=False)
    handle.wait()
    ```
    """
    called = time.perf_counter()
    progress = unless_background(progress, blocking)
    check_full_check_interval(full_check_interval_s)
    own_state = None
    if process_state is not None:  # taken now: the caller's iterator moves on
        own_state = OwnState(process_index(), process_count(), SavedState.of(process_state, process_count()))
    location = resolve(path)
    metadata = {} if metadata is None else metadata
    size = metadata_bytes(metadata)
    with collector_paused():  # records per leaf, no cycles among them
        records, arrays = _plan(tree)
    key = str(location)
    # One save in flight at a time: wait for the previous one, so at most one
    # snapshot is held in memory and its error, if any, is raised right here.
    SAVES.settle()
    if not is_multiprocess():
        location.check_target(overwrite)  # fail fast, on the caller's thread
    # Several processes: process 0 checks inside the first phase, so that all
    # of them see the same verdict and none waits at a barrier for nothing.
    phases = Phases() if is_multiprocess() else None
    leader = phases is None or phases.rank == 0
    # Which arrays are global, agreed before any process takes its pieces of them.
    spanning = None if phases is None else global_leaves([value for _, value in arrays], phases)
    with collector_paused():
        jobs = _jobs(snapshot(arrays, copy=not blocking, leader=leader, global_leaves=spanning))
        if phases is None:  # with several processes every leaf keeps its own array
            records, jobs = _pack(records, jobs)
    manifest = Manifest(tuple(records), metadata)
    # Before anything is written; with room for every process's state, each within its share.
    manifest.refuse_oversized(size + (0 if own_state is None else state_limit(process_count()) * process_count()))

    def run() -> None:
        # Only process 0's manifest is committed: the others hash nothing. Which leaves a
        # base holds is known by their digests; without one, they are hashed while written.
        hashing = None
        if leader and base is not None:
            with collector_paused():
                with_digests = digested(manifest, jobs)
        else:
            with_digests, hashing = manifest, Hashing(manifest, jobs) if leader else None
        try:
            # The base is opened here, off the caller's thread for a background save, and only
            # by the process that holds whole leaves (and their digests): process 0.
            with plan_reuse(base if leader else None, with_digests, jobs, location, full_check_interval_s) as reuse:
                pieces = [piece for job in reuse.written for piece in job.pieces]
                written = sum(p.nbytes for p in pieces)
                with reporting(f"saving {key}", written, sum(p.leaves for p in pieces), progress):
                    SaveInProgress(location, with_digests, reuse, overwrite, phases, hashing, own_state=own_state).run()
            record_duration(SAVE_COMMITTED, called)
            record_bytes(SAVE_BYTES, written)
        finally:
            if hashing is not None:  # done after a commit; stopped after a failure
                hashing.stop()

    if blocking:
        future: concurrent.futures.Future = concurrent.futures.Future()
        run()
        future.set_result(None)
        handle = SaveHandle(key, future)
    else:
        handle = SAVES.submit(key, run)
    record_duration(SAVE_BLOCKED, called)
    return handle


class Part:
    """This process's own part of a pytree, taken into host memory now (on the caller's
    thread: the caller may then donate, delete or mutate its arrays), to be saved as a
    checkpoint of this process's own by `write`, which the other processes of a JAX job
    take no part in. A local tier's parts are saved so.

    Every leaf is recorded as `save` records it (and what `save` refuses is refused here,
    with the same error); a global array this process holds only blocks of is stored as
    those blocks, each once (`StoredLeaf.blocks`).

    **Arguments:**

    - `tree`: any pytree `save` takes.
    - `copy`: take a private copy of numpy leaves (False: the caller leaves them alone
      until `write` returns).
    - `own_state`: this process's own state (`save`'s ``process_state``), committed with it.

    ```python
    part = Part(state)                                   # on the caller's thread
    part.write("local/process-0/own/50", metadata={})    # anywhere, later
    ```
    """

    def __init__(self, tree: PyTree, copy: bool = True, own_state: OwnState | None = None):
        self.own_state = own_state
        with collector_paused():
            records, arrays = _plan(tree)
            jobs = _jobs(snapshot(arrays, copy=copy, leader=True, multiprocess=False, own_blocks=True))
            held = {job.record.path: job.record for job in jobs}  # with the blocks each holds
            records = [held.get(r.path, r) for r in records]
            self.records, self.jobs = _pack(records, jobs)

    @property
    def nbytes(self) -> int:
        """The bytes it holds (and writes)."""
        return sum(piece.nbytes for job in self.jobs for piece in job.pieces)

    def write(
        self,
        path: CheckpointPath,
        *,
        metadata: dict[str, Any],
        overwrite: bool = False,
        durable: bool = True,
    ) -> None:
        """Save it as a checkpoint at ``path``, now, on the caller's thread; background saves
        in flight are not waited for.

        **Arguments:**

        - `path`: where, as for `save`.
        - `metadata`: a JSON-serialisable dict stored with the checkpoint.
        - `overwrite`: replace a checkpoint already there.
        - `durable`: make the arrays durable before the commit (False: they stay in the page
          cache for the kernel to write back; the commit itself is still atomic).

        **Returns:** nothing.
        """
        location = resolve(path)
        location.check_target(overwrite)
        manifest = Manifest(tuple(self.records), metadata)
        own = 0 if self.own_state is None else len(json.dumps(self.own_state.to_json()))
        manifest.refuse_oversized(metadata_bytes(metadata) + own)
        hashing = Hashing(manifest, self.jobs)
        try:
            with plan_reuse(None, manifest, self.jobs, location) as reuse:
                SaveInProgress(location, manifest, reuse, overwrite, None, hashing, durable, self.own_state).run()
        finally:
            hashing.stop()
