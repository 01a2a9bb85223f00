"""`save`: write a pytree as per-leaf zarr3 arrays plus a manifest, atomically."""

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import math
import os
import signal
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from jaxtyping import PyTree

from ._background import SAVES, SaveHandle
from ._checkpoint import Checkpoint, open_checkpoint
from ._chunks import ChunkLayout, encode
from ._digest import digest
from ._distributed import Phases, is_multiprocess
from ._errors import CheckpointChangedError, CheckpointError, CheckpointWriteError, plural
from ._leaf import Leaf, StoredLeaf
from ._manifest import Manifest
from ._pack import PACK_MIN_LEAVES, PackedWrite, assign_offsets, packable, packed_array
from ._paths import GROUP_METADATA, PACKED_LOCATION, group_file, group_locations, key_entry_record, reference
from ._pieces import Piece, record_of, snapshot
from ._progress import Progress, advance, reporting
from ._storage import (
    NOTHING_COMMITTED,
    CheckpointPath,
    Staging,
    Storage,
    expected_files,
    nothing_committed,
    resolve,
)
from ._store import is_storage_error, read_window, reason
from ._tree import flatten
from ._verify import damaged_leaves
from ._window import Task, run_windowed


@dataclasses.dataclass
class _WriteJob:
    """One array leaf to write: its record, the shard shape its chunks must tile
    (None: whole), its chunk layout (planned once, from those), and the pieces this
    process writes."""

    record: StoredLeaf
    shard: tuple[int, ...] | None
    pieces: list[Piece]

    @functools.cached_property
    def layout(self) -> ChunkLayout:
        # Planned on first use: by a background save, off the caller's thread.
        return ChunkLayout.planned(self.record, self.shard)


def _plan(tree: PyTree) -> tuple[list[Leaf], list[tuple[StoredLeaf, Any]]]:
    """Every leaf's manifest record, and the arrays to write (``LazyArray`` leaves
    are copied from their checkpoint)."""
    flat, _ = flatten(tree, empty_in_sequences=True)
    records: list[Leaf] = []
    arrays: list[tuple[StoredLeaf, Any]] = []
    for path, keypath, value in flat:
        if not path:
            raise CheckpointError(
                "save needs a container at the top of the tree (a module, dict, list...); "
                "wrap a single array, e.g. save(path, {'x': array})."
            )
        keys = tuple(tuple(key_entry_record(e)) for e in keypath)
        record, data = record_of(path, keys, value)
        records.append(record)
        if isinstance(record, StoredLeaf):
            arrays.append((record, data))
    return records, arrays


def _snapshot(arrays: list[tuple[StoredLeaf, Any]], copy: bool, leader: bool) -> list[_WriteJob]:
    """The pieces this process must write, in host memory it owns (see `_pieces.snapshot`)."""
    return [_WriteJob(record, shard, pieces) for record, shard, pieces in snapshot(arrays, copy, leader)]


def _pack(records: list[Leaf], leaves: list[_WriteJob]) -> tuple[list[Leaf], list[_WriteJob]]:
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
    array = packed_array(placed)
    assert array is not None
    written = PackedWrite(
        [
            (record.offset or 0, whole)
            for leaf, record in zip(small, placed)
            if (whole := leaf.pieces[0].whole) is not None
        ]
    )
    chosen = {id(leaf) for leaf in small}
    return (
        [where.get(id(record), record) for record in records],
        [leaf for leaf in leaves if id(leaf) not in chosen] + [_WriteJob(array, None, [written])],
    )


def _open_base(base: CheckpointPath | None, location: Storage) -> Checkpoint | None:
    """The checkpoint a save may take unchanged leaves from: one committed on a local disk,
    into another on a local disk (its files are linked), or one beside it on an object
    store (referred to); None where there is none to take from."""
    if base is None:
        return None
    try:
        source = open_checkpoint(base)
    except CheckpointError:  # gone, damaged, not one: nothing is taken from it
        return None
    if location.local is not None:
        return source if source.stored.arrays.local is not None else None
    return (
        source if location.sibling_name(source.stored.storage) is not None and source.stored.manifest.arrays else None
    )


# A batch of leaves hashed by one thread: large enough that a tree of many small leaves
# costs few tasks, small enough that two cores share a large tree's hashing.
DIGEST_BATCH_BYTES = 16 * 1024 * 1024


def _digested(manifest: Manifest, leaves: list[_WriteJob]) -> Manifest:
    """The manifest with the digest of each leaf this process holds whole in host memory
    (a leaf whose shards several processes write gets none; a copied leaf keeps its
    source's). Run where the writes run: off the caller's thread for a background save;
    batches of leaves are hashed on every core (the hash releases the GIL)."""
    by_offset = {r.offset: r for r in manifest.leaves if isinstance(r, StoredLeaf) and r.offset is not None}
    whole: list[tuple[StoredLeaf, np.ndarray]] = []
    for leaf in leaves:
        if len(leaf.pieces) != 1:
            continue
        for offset, data in leaf.pieces[0].hashed():
            if offset is not None:
                whole.append((by_offset[offset], data))
            elif data.shape == leaf.record.data_shape:
                whole.append((leaf.record, data))
    batches: list[list[tuple[StoredLeaf, np.ndarray]]] = [[]]
    size = 0
    for record, data in whole:
        if size >= DIGEST_BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append((record, data))
        size += data.nbytes
    digests: dict[str, str] = {}

    def hash_batches(share: list[list[tuple[StoredLeaf, np.ndarray]]]) -> None:
        for batch in share:
            digests.update((r.path, digest(r.digest_fields(), data)) for r, data in batch)

    # Plain threads, not an executor: a background save may run while the interpreter
    # exits, when executors take no new work.
    workers = min(len(batches), os.cpu_count() or 1)
    threads = [threading.Thread(target=hash_batches, args=(batches[i::workers],)) for i in range(1, workers)]
    for thread in threads:
        thread.start()
    hash_batches(batches[0::workers])
    for thread in threads:
        thread.join()
    if len(digests) != len(whole):
        raise CheckpointWriteError(f"Hashing the leaves failed (see above). {NOTHING_COMMITTED}")
    records = [
        dataclasses.replace(r, digest=digests[r.path]) if isinstance(r, StoredLeaf) and r.path in digests else r
        for r in manifest.leaves
    ]
    return dataclasses.replace(manifest, leaves=tuple(records))


def _unchanged(base: Checkpoint, manifest: Manifest, leaves: list[_WriteJob]) -> Iterator[tuple[_WriteJob, StoredLeaf]]:
    """The jobs whose leaf ``base`` already holds as this save would write it, with base's
    leaf: same path and digest (so kind, dtype and shape), each in an array of its own."""
    recorded = {r.path: r for r in manifest.leaves if isinstance(r, StoredLeaf)}
    for leaf in leaves:
        if leaf.record.path == PACKED_LOCATION:
            if base.stored.packed is not None and _same_packing(manifest, base.stored.manifest):
                yield leaf, base.stored.packed
            continue
        new, old = recorded.get(leaf.record.path), base.stored.records.get(leaf.record.path)
        if not (
            new is None  # the packed array: rewritten whole
            or leaf.shard is not None
            or new.offset is not None
            or new.digest is None
            or not isinstance(old, StoredLeaf)
            or old.offset is not None
            or (old.digest, old.digest_fields()) != (new.digest, new.digest_fields())
        ):
            yield leaf, old


def _same_packing(new: Manifest, old: Manifest) -> bool:
    """Whether two manifests pack the same leaves, with the same digests, at the same offsets:
    then the packed arrays are the same bytes."""

    def packing(manifest: Manifest) -> set[tuple[Any, ...]] | None:
        packed = [r for r in manifest.leaves if isinstance(r, StoredLeaf) and r.offset is not None]
        if any(r.digest is None for r in packed):
            return None
        return {(r.path, r.offset, r.digest, json.dumps(r.digest_fields())) for r in packed}

    found = packing(new)
    return found is not None and found == packing(old)


def _reusable(base: Checkpoint, manifest: Manifest, leaves: list[_WriteJob]) -> dict[int, list[str]]:
    """The unchanged leaves of ``base`` (a committed checkpoint on a local disk) whose files
    are plain files exactly as `expected_files` lays the leaf out, and intact (`_intact`),
    by ``id`` of their job, with the files to take."""
    laid_out: list[tuple[_WriteJob, StoredLeaf]] = []
    files: dict[int, list[str]] = {}
    for leaf, old in _unchanged(base, manifest, leaves):
        expected = {
            k: v for k, v in expected_files([(old, ChunkLayout.planned(old))]).items() if k.startswith(f"{old.path}/")
        }
        found = base.stored.leaf_files(old.path)
        if found is not None and found.keys() == expected.keys():
            if all(size < 0 or found[key] == size for key, size in expected.items()):
                laid_out.append((leaf, old))
                files[id(leaf)] = sorted(found)
    return {id(leaf): files[id(leaf)] for leaf, _ in _intact(base, laid_out)}


def _referable(base: Checkpoint, manifest: Manifest, leaves: list[_WriteJob], location: Storage) -> dict[int, str]:
    """The unchanged and intact (`_intact`) leaves of ``base`` (a committed checkpoint beside
    this one on an object store), by ``id`` of their job, with the prefix their array is in
    (base's own, or the one base refers to: references are never chained)."""
    entry = location.sibling_name(base.stored.storage)
    assert entry is not None
    own = reference(entry, base.stored.manifest.arrays)
    return {id(leaf): old.arrays or own for leaf, old in _intact(base, list(_unchanged(base, manifest, leaves)))}


def _intact(base: Checkpoint, taken: list[tuple[_WriteJob, StoredLeaf]]) -> list[tuple[_WriteJob, StoredLeaf]]:
    """Of ``taken`` (unchanged leaves, each with ``base``'s record of it), those whose bytes
    in ``base`` pass every check `verify` makes (chunks' CRC-32C, digests): a save shares
    nothing unchecked, or one bit flipped in ``base`` would be in every later checkpoint.
    The others are written afresh from the values being saved, with a warning naming them.
    Raises `CheckpointChangedError` if ``base`` was replaced or deleted meanwhile."""
    members = [r for r in base.stored.manifest.leaves if isinstance(r, StoredLeaf) and r.offset is not None]
    records = {id(leaf): members if old.path == PACKED_LOCATION else [old] for leaf, old in taken}
    damaged = damaged_leaves(base, [r for group in records.values() for r in group]) if taken else {}
    intact: list[tuple[_WriteJob, StoredLeaf]] = []
    for leaf, old in taken:
        bad = [r.path for r in records[id(leaf)] if r.path in damaged]
        if not bad:
            intact.append((leaf, old))
            continue
        what = f"Leaf {bad[0]!r}" if old.path != PACKED_LOCATION else f"Packed leaf {bad[0]!r}"
        others = f" (and {plural(len(bad) - 1, 'other packed leaf', 'other packed leaves')})" if len(bad) > 1 else ""
        warnings.warn(
            f"{what}{others} of {base.location}, which this save would share unchanged, is damaged there "
            f"({damaged[bad[0]].rstrip('.')}). This save writes it again from the values being saved; "
            f"{base.location} itself stays damaged (eqxckpt verify names every checkpoint sharing it).",
            stacklevel=2,
        )
    return intact


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold back Ctrl-C (SIGINT) until the block is done, then raise it. Only the main
    thread receives signals, and only Python's default handler is replaced."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    received: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if received:
            raise KeyboardInterrupt


def _write(target: Storage, leaves: list[_WriteJob], *, metadata: bool, chunks: bool) -> None:
    """Write each leaf's ``zarr.json`` (``metadata``) and its pieces' chunks (``chunks``),
    all through one window: a chunk's values are produced (a view of host memory, a packed
    chunk assembled, a copied chunk read) on an I/O thread just before it is written.

    Views reference the source buffers rather than copy them: nothing changes them while
    we wait, since jax arrays are immutable, an async save copied its numpy leaves, and
    a blocking save returns only afterwards. Nothing is still writing when this returns
    or raises, so a failed save can remove its files."""
    files = target.chunk_files()

    def written(record: StoredLeaf, key: str, produce: Callable[[], list[np.ndarray]]) -> Callable[[], None]:
        def work() -> None:
            try:
                files.write(f"{record.path}/{key}", produce())
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


def _referring(manifest: Manifest, refs: dict[str, str]) -> Manifest:
    """The manifest with each leaf at a path in ``refs`` naming the prefix its array is in
    (every packed leaf, if the packed array is in ``refs``)."""
    where = lambda r: refs.get(PACKED_LOCATION if r.offset is not None else r.path)  # noqa: E731
    records = [
        dataclasses.replace(r, arrays=where(r)) if isinstance(r, StoredLeaf) and where(r) else r
        for r in manifest.leaves
    ]
    return dataclasses.replace(manifest, leaves=tuple(records))


def _run(
    location: Storage,
    manifest: Manifest,
    leaves: list[_WriteJob],
    overwrite: bool,
    phases: Phases | None,
    base: Checkpoint | None = None,
    linked: Sequence[tuple[_WriteJob, list[str]]] = (),
    referred: Sequence[tuple[_WriteJob, str]] = (),
) -> None:
    """Prepare, write, commit. With several processes each phase ends at a barrier,
    and process 0 alone prepares the layout and commits. ``linked`` leaves are taken
    from ``base`` as they are (those files), not written; ``referred`` ones stay in the
    sibling prefix named with each (object stores), unless it cannot be held for this
    save: then they are written."""
    leader = phases is None or phases.rank == 0
    leaves = list(leaves)
    run = phases.run if phases is not None else (lambda _, work: [work()])
    staging: Staging | None = None

    def prepare() -> str | None:
        nonlocal staging
        if not leader:
            return None
        nonlocal manifest
        everything = [*leaves, *(leaf for leaf, _ in linked), *(leaf for leaf, _ in referred)]
        staging = location.begin_save([leaf.record.path for leaf in everything], overwrite)
        if referred:
            held = staging.refer(sorted({ref for _, ref in referred}))
            manifest = _referring(manifest, {leaf.record.path: ref for leaf, ref in referred if ref in held})
            leaves.extend(leaf for leaf, ref in referred if ref not in held)  # doomed meanwhile: written
        # The directories above the arrays become zarr groups, written while the arrays are created.
        store = staging.storage.open_kvstore()
        own = [*leaves, *(leaf for leaf, _ in linked)]
        groups = [store.write(group_file(g), GROUP_METADATA) for g in group_locations(leaf.record.path for leaf in own)]
        if linked:
            assert base is not None
            staging.link_files(base.stored.arrays, [key for _, keys in linked for key in keys])
            base.check_unchanged()  # what was linked may not be what its manifest describes
        try:  # every process then writes its chunks into these arrays
            _write(staging.storage, leaves, metadata=True, chunks=False)
        finally:  # nothing may still be writing when a failed save removes its files
            failures = [written.exception() for written in groups]  # (Ctrl-C is held back here)
        for failure in failures:
            if failure is not None:
                raise failure
        return staging.where

    def write(where: str) -> None:
        nonlocal staging
        if staging is None:
            staging = location.join_save(where)
        with contextlib.ExitStack() as sources:
            # Leaves copied from other checkpoints: those must stay the same until written.
            copied = {id(p.source): p.source for leaf in leaves for p in leaf.pieces if p.source is not None}
            for source in copied.values():
                sources.enter_context(source.consistent())
            _write(staging.storage, leaves, metadata=False, chunks=True)
        staging.sync()

    def commit() -> None:
        if leader and staging is not None:
            jobs = [*leaves, *(leaf for leaf, _ in linked)]
            staging.commit(manifest, expected_files([(leaf.record, leaf.layout) for leaf in jobs]))

    try:
        # Ctrl-C waits while a staging directory is made and recorded, or committed:
        # interrupted there, one would be left behind half made. Writes stay interruptible.
        with interrupts_deferred():
            [where, *_] = run("prepare", prepare)
        run("write", lambda: write(where or ""))
        with interrupts_deferred():
            run("commit", commit)
    except BaseException as e:
        if staging is not None:
            with interrupts_deferred():
                staging.abort(e)
        if isinstance(e, OSError) and not isinstance(e, CheckpointError):
            error = CheckpointWriteError(f"Saving to {location} failed: {e}. {NOTHING_COMMITTED}")
            error.errno = e.errno
            raise error from e
        if is_storage_error(e):
            why = reason(e)
            raise CheckpointWriteError(f"Saving to {location} failed: {why}. {nothing_committed(why)}") from e
        raise
    finally:
        if staging is not None:
            staging.release()


def save(
    path: CheckpointPath,
    tree: PyTree,
    *,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    blocking: bool = True,
    progress: Progress = False,
    base: CheckpointPath | None = None,
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
    - `progress`: True shows a progress bar (bytes and leaves, rate, time
      left) on stderr when it is a terminal; a callable receives
      ``(done_bytes, total_bytes, done_leaves, total_leaves)`` after each leaf.
      Off by default.
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

    With several JAX processes (``jax.process_count() > 1``) every process
    calls `save` with the same tree of global arrays; each writes only its own
    shards, and process 0 commits once all have finished.

    **Returns:** a `SaveHandle` (already finished when ``blocking=True``).

    ```python
    model = eqx.nn.MLP(2, 2, 8, 2, key=jax.random.key(0))
    eqxckpt.save("checkpoints/step_0", {"model": model}, metadata={"step": 0})
    handle = eqxckpt.save("checkpoints/step_1", {"model": model}, blocking=False)
    handle.wait()
    ```
    """
    location = resolve(path)
    metadata = {} if metadata is None else metadata
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"metadata must be a JSON-serialisable dict: {e}") from None
    if not isinstance(metadata, dict):
        raise CheckpointError(f"metadata must be a dict, got {type(metadata).__name__}.")
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
    leaves = _snapshot(arrays, copy=not blocking, leader=phases is None or phases.rank == 0)
    if phases is None:  # with several processes every leaf keeps its own array
        records, leaves = _pack(records, leaves)
    manifest = Manifest(tuple(records), metadata)

    def run() -> None:
        digested = _digested(manifest, leaves)
        with contextlib.ExitStack() as held:
            # Opened here, off the caller's thread for a background save, and only by the
            # process that holds whole leaves (and their digests): process 0.
            source = _open_base(base, location) if phases is None or phases.rank == 0 else None
            reusable: dict[int, list[str]] = {}
            referable: dict[int, str] = {}
            if source is not None and source.stored.arrays.local is None:
                try:
                    referable = _referable(source, digested, leaves, location)
                except CheckpointChangedError:
                    pass  # replaced or deleted meanwhile: everything is written
            elif source is not None:
                try:  # held, not deleted by retention, while its files are checked and linked
                    held.enter_context(source.held())
                    reusable = _reusable(source, digested, leaves)
                except CheckpointChangedError:
                    pass  # deleted meanwhile: everything is written
                if not reusable:
                    held.close()
            linked = [(leaf, reusable[id(leaf)]) for leaf in leaves if id(leaf) in reusable]
            referred = [(leaf, referable[id(leaf)]) for leaf in leaves if id(leaf) in referable]
            writing = [leaf for leaf in leaves if id(leaf) not in reusable and id(leaf) not in referable]
            pieces = [piece for leaf in writing for piece in leaf.pieces]
            with reporting(f"saving {key}", sum(p.nbytes for p in pieces), sum(p.leaves for p in pieces), progress):
                _run(location, digested, writing, overwrite, phases, source, linked, referred)

    if blocking:
        future: concurrent.futures.Future = concurrent.futures.Future()
        run()
        future.set_result(None)
        return SaveHandle(key, future)
    return SAVES.submit(key, run)
