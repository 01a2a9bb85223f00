"""`save`: write a pytree as per-leaf zarr3 arrays plus a manifest, atomically."""

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
import tensorstore as ts
from jaxtyping import PyTree

from ._background import SAVES, SaveHandle
from ._checkpoint import Checkpoint, LazyArray, open_checkpoint
from ._digest import digest
from ._distributed import Phases, is_multiprocess
from ._errors import CheckpointChangedError, CheckpointError, CheckpointWriteError
from ._leaf import Leaf, StoredLeaf, leaf_of
from ._manifest import Manifest
from ._pack import PACK_MIN_LEAVES, PackedWrite, assign_offsets, packable, packed_array
from ._paths import GROUP_METADATA, PACKED_LOCATION, group_file, group_locations, key_entry_record, reference
from ._progress import Progress, advance, reporting
from ._source import LazyEntry, Source
from ._storage import (
    NOTHING_COMMITTED,
    CheckpointPath,
    Staging,
    Storage,
    expected_files,
    nothing_committed,
    resolve,
)
from ._store import array_spec, chunk_budget, chunk_regions, is_storage_error, read_window, reason, shared_context
from ._tree import flatten


@dataclasses.dataclass
class _WriteJob:
    """One array leaf to write: its record, the shard shape its chunks must tile,
    and the pieces this process writes as (index or None for whole, data)."""

    record: StoredLeaf
    shard: tuple[int, ...] | None
    pieces: list[tuple[tuple[slice, ...] | None, Any]]


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
        if isinstance(value, LazyEntry):
            record, data = value._saved_as(path, keys), value
        else:
            record, data = leaf_of(path, keys, value)
        records.append(record)
        if isinstance(record, StoredLeaf):
            arrays.append((record, data))
    return records, arrays


def _snapshot(arrays: list[tuple[StoredLeaf, Any]], copy: bool, leader: bool) -> list[_WriteJob]:
    """The bytes this process must write, in host memory it owns.

    Only shards with ``replica_id == 0`` are taken, so every element is written
    by exactly one process; host-local leaves (numpy, fully addressable arrays
    in a multi-process run) are written by process 0 alone. ``copy``: take a
    private copy of numpy leaves, which the caller may mutate afterwards.
    """
    multiprocess = is_multiprocess()
    leaves: list[_WriteJob] = []
    for record, value in arrays:
        if isinstance(value, jax.Array) and isinstance(value.sharding, jax.sharding.SingleDeviceSharding):
            # The common case, without asking for shards (costly per leaf in a tree of many small ones).
            leaves.append(_WriteJob(record, None, [(None, value)] if leader or not multiprocess else []))
        elif isinstance(value, jax.Array):
            if multiprocess and value.is_fully_addressable and not leader:
                shards = []
            else:
                shards = [s for s in value.addressable_shards if s.replica_id == 0]
            whole = len(value.sharding.device_set) == 1
            shard = None if whole else tuple(value.sharding.shard_shape(value.shape))
            leaves.append(_WriteJob(record, shard, [(None if whole else s.index, s.data) for s in shards]))
        else:
            leaves.append(_WriteJob(record, None, [(None, value)] if leader or not multiprocess else []))
    # Start every device-to-host transfer before waiting on any (a no-op on CPU).
    # A LazyArray stays as it is: it is copied from its checkpoint piece by piece.
    for leaf in leaves:
        for _, data in leaf.pieces:
            if isinstance(data, jax.Array) and not _on_cpu(data):
                data.copy_to_host_async()
    for leaf in leaves:
        leaf.pieces = [
            (index, data if isinstance(data, LazyEntry) else _host(data, copy)) for index, data in leaf.pieces
        ]
    return leaves


def _pack(records: list[Leaf], leaves: list[_WriteJob]) -> tuple[list[Leaf], list[_WriteJob]]:
    """Small leaves written whole from host memory go into the packed array (see `_pack`)
    when there are enough of them to be worth it; the records say where each one is."""
    small = [
        leaf
        for leaf in leaves
        if leaf.shard is None
        and len(leaf.pieces) == 1
        and leaf.pieces[0][0] is None
        and isinstance(leaf.pieces[0][1], np.ndarray)
        and packable(leaf.record)
    ]
    if len(small) < PACK_MIN_LEAVES:
        return records, leaves
    placed = assign_offsets([leaf.record for leaf in small])
    where = {id(leaf.record): record for leaf, record in zip(small, placed)}
    array = packed_array(placed)
    assert array is not None
    written = PackedWrite([(record.offset or 0, leaf.pieces[0][1]) for leaf, record in zip(small, placed)])
    chosen = {id(leaf) for leaf in small}
    return (
        [where.get(id(record), record) for record in records],
        [leaf for leaf in leaves if id(leaf) not in chosen] + [_WriteJob(array, None, [(None, written)])],
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
        return source if source._arrays.local is not None else None
    return source if location.sibling_name(source.location) is not None and source._manifest.arrays else None


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
        [(index, data)] = leaf.pieces
        if isinstance(data, PackedWrite):
            whole.extend((by_offset[offset], member) for offset, member in data.members)
        elif (
            isinstance(data, np.ndarray)
            and (index is None or all(part == slice(None) for part in index))
            and data.shape == leaf.record.data_shape
        ):
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
            if base._packed is not None and _same_packing(manifest, base._manifest):
                yield leaf, base._packed
            continue
        new, old = recorded.get(leaf.record.path), base._leaves.get(leaf.record.path)
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
    are plain files exactly as `expected_files` lays the leaf out, by ``id`` of their job,
    with the files to take."""
    reusable: dict[int, list[str]] = {}
    for leaf, old in _unchanged(base, manifest, leaves):
        expected = {k: v for k, v in expected_files([(old, None)]).items() if k.startswith(f"{old.path}/")}
        found = base._arrays.leaf_files(old.path)
        if found is not None and found.keys() == expected.keys():
            if all(size < 0 or found[key] == size for key, size in expected.items()):
                reusable[id(leaf)] = sorted(found)
    return reusable


def _referable(base: Checkpoint, manifest: Manifest, leaves: list[_WriteJob], location: Storage) -> dict[int, str]:
    """The unchanged leaves of ``base`` (a committed checkpoint beside this one on an object
    store), by ``id`` of their job, with the prefix their array is in (base's own, or the
    one base refers to: references are never chained)."""
    entry = location.sibling_name(base.location)
    assert entry is not None
    own = reference(entry, base._manifest.arrays)
    return {id(leaf): old.arrays or own for leaf, old in _unchanged(base, manifest, leaves)}


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


def _on_cpu(array: jax.Array) -> bool:
    return all(d.platform == "cpu" for d in array.sharding.device_set)


def _host(value: Any, copy: bool) -> np.ndarray:
    """``value`` in host memory that nothing else will change.

    A device array's host copy is fresh. A CPU jax array needs no copy: the
    numpy view holds an external reference to its buffer, which keeps the
    buffer alive and unchanged if the caller deletes the array or donates it
    to a jitted step (XLA then writes the step's output elsewhere). This is
    what lets an async save return in ~0.01 s instead of ~0.8 s for 792 MiB
    (`tests/test_save.py` checks donation and deletion). Numpy arrays are
    mutable, so an async save copies them.
    """
    if isinstance(value, jax.Array):
        return np.asarray(value)
    return np.array(value, copy=True) if copy else np.asarray(value)


def _settle(
    futures: Sequence[tuple[Leaf, Any]], action: str, done: Sequence[tuple[int, int]] | None = None
) -> list[Any]:
    """Every future's result. On failure, raise only once all have finished, so
    nothing is still writing into a directory that the caller then removes.
    ``done``: the (bytes, leaves) each future completes, counted (progress) as it settles."""
    results: list[Any] = []
    failure: BaseException | None = None
    # Ctrl-C waits until every future has settled: a write still running could
    # recreate files of a save that the interrupt then removes.
    with interrupts_deferred():
        for i, (record, future) in enumerate(futures):
            try:
                results.append(future.result())
            except Exception as e:  # noqa: BLE001 - the first is raised below, after the rest settle
                results.append(None)
                if failure is None:
                    why = reason(e)
                    failure = CheckpointWriteError(
                        f"{action} leaf {record.path!r} failed: {why}. {nothing_committed(why)}"
                    )
                    failure.__cause__ = e
                continue
            if done is not None and failure is None:
                try:
                    advance(*done[i])
                except BaseException as e:  # noqa: BLE001 - the user's progress callback: raised as itself
                    failure = e
    if failure is not None:
        raise failure
    return results


def _open_arrays(target: Storage, leaves: list[_WriteJob], create: bool) -> list[ts.TensorStore]:
    # Every open is issued before any is awaited: TensorStore runs them concurrently.
    opens = [
        (
            leaf.record,
            ts.open(
                array_spec(
                    target.child(leaf.record.path),
                    leaf.record.data_shape,
                    np.dtype(leaf.record.dtype),
                    leaf.shard,
                    create=create,
                    budget=chunk_budget(leaf.record.path),
                ),
                context=shared_context(),
            ),
        )
        for leaf in leaves
    ]
    return _settle(opens, "Creating the array of" if create else "Opening the array of")


def _write_chunks(
    store: ts.TensorStore, record: StoredLeaf, index: tuple[slice, ...] | None, data: Any, reference: bool
) -> list[tuple[StoredLeaf, Any]]:
    """Write ``data`` at ``index`` (None: the whole array) with one write per chunk.

    A write of several chunks can report a failure while its other chunks are still
    being written, so a failed save could remove its files and see them recreated;
    a one-chunk write has settled when its future has. ``reference``: TensorStore may
    keep referencing ``data`` (host memory nothing changes) instead of copying it.
    """
    shape = store.shape
    if index is None:
        region = tuple(slice(0, n) for n in shape)
    else:
        region = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))
    chunk = store.chunk_layout.write_chunk.shape or ()
    known = len(chunk) == len(region) and all(c is not None for c in chunk)
    parts = chunk_regions([int(c or 0) for c in chunk], region) if known else [region]
    if len(parts) == 1:
        return [(record, store[region].write(data, can_reference_source_data_indefinitely=reference))]
    if isinstance(data, ts.TensorStore):
        data = data.translate_to[0]  # a lazy selection keeps its origin; index it from 0 like the region
    return [
        (
            record,
            store[part].write(
                data[tuple(slice(p.start - r.start, p.stop - r.start) for p, r in zip(part, region))],
                can_reference_source_data_indefinitely=reference,
            ),
        )
        for part in parts
    ]


def _counts(writes: list, nbytes: int, leaves: int = 1) -> list[tuple[int, int]]:
    """What each write of one piece completes (progress): its bytes spread over them, its leaves on the last."""
    if not writes:
        return []
    share = nbytes // len(writes)
    return [(share, 0)] * (len(writes) - 1) + [(nbytes - share * (len(writes) - 1), leaves)]


def _write_pieces(stores: list[ts.TensorStore], leaves: list[_WriteJob]) -> None:
    # All writes are issued before any is awaited, so they run concurrently.
    # TensorStore may reference the source buffers instead of copying them
    # (a blocking save then adds ~2% to peak memory, not a whole copy): nothing
    # changes them while we wait, since jax arrays are immutable, an async
    # save copied its numpy leaves, and a blocking save returns only afterwards.
    writes: list = []
    done: list = []
    try:
        for store, leaf in zip(stores, leaves):
            for index, data in leaf.pieces:
                if not isinstance(data, (LazyEntry, PackedWrite)):
                    piece = _write_chunks(store, leaf.record, index, data, reference=True)
                    writes += piece
                    done += _counts(piece, data.nbytes)
        for store, leaf in zip(stores, leaves):
            for _, data in leaf.pieces:
                if isinstance(data, PackedWrite):
                    _write_packed(store, leaf.record, data)
    finally:  # nothing may still be writing when a failed save removes its files
        _settle(writes, "Writing", done)
    # Leaves from another checkpoint are streamed, a window of bytes at a time,
    # so copying a checkpoint never holds the whole of it in memory.
    copies = [
        (store, leaf.record, data)
        for store, leaf in zip(stores, leaves)
        for _, data in leaf.pieces
        if isinstance(data, LazyEntry)
    ]
    window = read_window(sum(data.nbytes for _, _, data in copies))
    batches: list[list] = [[]]
    size = 0
    for copy in copies:
        if batches[-1] and size + copy[2].nbytes > window:
            batches.append([])
            size = 0
        batches[-1].append(copy)
        size += copy[2].nbytes
    for batch in batches:
        writes, done = [], []
        try:
            for store, record, data in batch:
                piece = _write_chunks(store, record, None, _copy_from(data), reference=False)
                writes += piece
                done += _counts(piece, data.nbytes)
        finally:
            _settle(writes, "Copying", done)


def _write_packed(store: ts.TensorStore, record: StoredLeaf, packed: PackedWrite) -> None:
    """The packed array, a batch at a time: the next batch is assembled while the one
    before is being written, and only then is that one settled."""
    writing: list = []
    done: list = []
    for start, batch, leaves in packed.batches():  # assembled while the batch before is written
        _settle(writing, "Writing", done)  # and settled before more is issued: a failure leaves nothing running
        writing = _write_chunks(store, record, (slice(start, start + batch.size),), batch, reference=True)
        done = _counts(writing, batch.size, leaves)
    _settle(writing, "Writing", done)


def _copy_from(data: LazyEntry) -> Any:
    """What a copy writes: an eqxckpt leaf as a TensorStore view (streamed chunk by
    chunk), a foreign format's tensor read whole (one at a time, within the batch)."""
    return data._stream() if isinstance(data, LazyArray) else data.get()


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
    created: list[ts.TensorStore] | None = None

    def prepare() -> str | None:
        nonlocal staging, created
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
            staging.link_files(base._arrays, [key for _, keys in linked for key in keys])
            if base._pin is not None and base._pin.changed():
                raise base._changed()  # what was linked may not be what its manifest describes
        try:
            created = _open_arrays(staging.storage, leaves, create=True)
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
        mine = leaves if created is not None else [leaf for leaf in leaves if leaf.pieces]
        with contextlib.ExitStack() as sources:
            # Leaves copied from other checkpoints: those must stay the same until written.
            copied: dict[int, Source] = {
                id(d.source): d.source for leaf in mine for _, d in leaf.pieces if isinstance(d, LazyEntry)
            }
            for source in copied.values():
                sources.enter_context(source.consistent())
            _write_pieces(created if created is not None else _open_arrays(staging.storage, mine, create=False), mine)
        staging.sync()

    def commit() -> None:
        if leader and staging is not None:
            jobs = [*leaves, *(leaf for leaf, _ in linked)]
            staging.commit(manifest, expected_files([(leaf.record, leaf.shard) for leaf in jobs]))

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
      leaves are stored at their key path (``model/layers/0/weight``); Python
      scalars and strings go into the manifest; other leaves (functions) are
      recorded by type and restored from ``like`` on load.
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
      same path is not written again. On a local disk (``base`` on the same
      disk) it is hard-linked from ``base`` (copied where links are refused):
      the new checkpoint is complete on its own, and deleting ``base`` later
      leaves it whole. On an object store (``base`` beside ``path``, in the
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
            if source is not None and source._arrays.local is None:
                referable = _referable(source, digested, leaves, location)
            elif source is not None:
                try:  # held, not deleted by retention, while its files are checked and linked
                    held.enter_context(source._held())
                    reusable = _reusable(source, digested, leaves)
                except CheckpointChangedError:
                    pass  # deleted meanwhile: everything is written
                if not reusable:
                    held.close()
            linked = [(leaf, reusable[id(leaf)]) for leaf in leaves if id(leaf) in reusable]
            referred = [(leaf, referable[id(leaf)]) for leaf in leaves if id(leaf) in referable]
            writing = [leaf for leaf in leaves if id(leaf) not in reusable and id(leaf) not in referable]
            pieces = [data for leaf in writing for _, data in leaf.pieces]
            counts = [len(data.members) if isinstance(data, PackedWrite) else 1 for data in pieces]
            with reporting(f"saving {key}", sum(data.nbytes for data in pieces), sum(counts), progress):
                _run(location, digested, writing, overwrite, phases, source, linked, referred)

    if blocking:
        future: concurrent.futures.Future = concurrent.futures.Future()
        run()
        future.set_result(None)
        return SaveHandle(key, future)
    return SAVES.submit(key, run)
