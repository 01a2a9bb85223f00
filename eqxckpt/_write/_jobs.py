"""A save's jobs: each array leaf it writes (`WriteJob`: its record, the shard shape its
chunks tile, its layout, the pieces this process writes), and their digests, computed
before the writes (`digested`, for a save with a base) or beside them (`Hashing`)."""

import dataclasses
import functools
import os
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._chunks import ChunkLayout
from .._digest import Tiled, digest
from .._errors import CheckpointWriteError
from .._gc import collector_paused
from .._leaf import StoredLeaf, with_storage
from .._manifest import Manifest
from .._read._place import Block, slice_key
from .._storage import (
    NOTHING_COMMITTED,
)
from ._pieces import HostPiece, Piece


@dataclasses.dataclass
class WriteJob:
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


# A batch of leaves hashed by one thread: large enough that a tree of many small leaves
# costs few tasks, small enough that two cores share a large tree's hashing.
DIGEST_BATCH_BYTES = 16 * 1024 * 1024


class JaxDigests:
    """The digests of `jax.Array` leaves that earlier saves of this process hashed.

    A `jax.Array`'s values never change (one donated or deleted cannot be saved), so the
    digest of one array object, with the same digest fields (kind, stored dtype, shape),
    holds while that object lives: a frozen model's arrays, saved with every incremental
    step, are hashed once. Numpy arrays change in place: they are hashed every save.

    ```python
    JAX_DIGESTS.known(array, record.digest_fields())  # None: not hashed yet
    ```
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()  # (a weak reference's callback may run inside it)
        self._known: dict[int, tuple[weakref.ref, list[Any], str]] = {}

    def known(self, value: Any, fields: list[Any]) -> str | None:
        """The digest of ``value`` (this very object) with ``fields``, if one was hashed."""
        with self._lock:
            entry = self._known.get(id(value))
        return entry[2] if entry is not None and entry[0]() is value and entry[1] == fields else None

    def remember(self, value: Any, fields: list[Any], found: str) -> None:
        """Keep ``found``, the digest of ``value`` with ``fields``, while ``value`` lives."""
        key = id(value)

        def forget(ref: weakref.ref, key: int = key) -> None:
            with self._lock:
                if (entry := self._known.get(key)) is not None and entry[0] is ref:
                    del self._known[key]

        with self._lock:
            self._known[key] = (weakref.ref(value, forget), fields, found)


JAX_DIGESTS = JaxDigests()


def digested(
    manifest: Manifest,
    leaves: list[WriteJob],
    stop: threading.Event | None = None,
    values: Mapping[str, Any] | None = None,
) -> Manifest:
    """The manifest with the digest of each leaf this process holds whole in host memory
    (a leaf whose shards several processes write gets none; a copied leaf keeps its
    source's). Run where the writes run: off the caller's thread for a background save;
    batches of leaves are hashed on every core (the hash releases the GIL). ``values``:
    the value saved at each leaf's path; a `jax.Array` among them hashed before
    (`JAX_DIGESTS`) is not hashed again."""
    import jax

    arrays = {path: v for path, v in (values or {}).items() if isinstance(v, jax.Array)}
    by_offset = {r.offset: r for r in manifest.leaves if isinstance(r, StoredLeaf) and r.offset is not None}
    whole: list[tuple[StoredLeaf, np.ndarray | list[np.ndarray] | Tiled]] = []
    for leaf in leaves:
        if leaf.record.blocks is not None:  # a part's blocks, each whole here, in order
            whole.append((leaf.record, [piece.data for piece in leaf.pieces if isinstance(piece, HostPiece)]))
            continue
        if len(leaf.pieces) != 1:
            if (tiled := _tiled(leaf)) is not None:
                whole.append((leaf.record, tiled))
            continue
        for offset, data in leaf.pieces[0].hashed():
            if offset is not None:
                whole.append((by_offset[offset], data))
            elif data.shape == leaf.record.data_shape:
                whole.append((leaf.record, data))
    digests: dict[str, str] = {}
    for record, _ in whole:
        if (value := arrays.get(record.path)) is not None:
            if (found := JAX_DIGESTS.known(value, record.digest_fields())) is not None:
                digests[record.path] = found
    batches: list[list[tuple[StoredLeaf, np.ndarray | list[np.ndarray] | Tiled]]] = [[]]
    size = 0
    for record, data in whole:
        if record.path in digests:
            continue
        if size >= DIGEST_BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append((record, data))
        size += record.nbytes
    failures: list[tuple[str, Exception]] = []

    def hash_batches(share: list[list[tuple[StoredLeaf, np.ndarray | list[np.ndarray] | Tiled]]]) -> None:
        for batch in share:
            if stop is not None and stop.is_set():
                return  # the save failed meanwhile: its digests are never used
            for record, data in batch:
                try:
                    digests[record.path] = digest(record.digest_fields(), data)
                except Exception as e:  # raised below, naming the leaf, whichever thread hashed it
                    failures.append((record.path, e))
                    return

    # Plain threads, not an executor: a background save may run while the interpreter
    # exits, when executors take no new work.
    workers = min(len(batches), os.cpu_count() or 1)
    threads = [threading.Thread(target=hash_batches, args=(batches[i::workers],)) for i in range(1, workers)]
    for thread in threads:
        thread.start()
    hash_batches(batches[0::workers])
    for thread in threads:
        thread.join()
    if failures:
        path, e = failures[0]
        raise CheckpointWriteError(f"Hashing leaf {path!r} failed: {e!r}. {NOTHING_COMMITTED}") from e
    if len(digests) != len(whole):
        raise CheckpointWriteError(f"Hashing the leaves failed (see above). {NOTHING_COMMITTED}")
    for record, _ in whole:
        if (value := arrays.get(record.path)) is not None:
            JAX_DIGESTS.remember(value, record.digest_fields(), digests[record.path])
    records = [
        with_storage(r, digest=digests[r.path]) if isinstance(r, StoredLeaf) and r.path in digests else r
        for r in manifest.leaves
    ]
    return dataclasses.replace(manifest, leaves=tuple(records))


def _tiled(leaf: WriteJob) -> Tiled | None:
    """A leaf this process holds as shards that tile it (a sharded array on this process's
    devices alone), to digest whole; None if other processes hold or write some of it."""
    blocks: dict[Block, np.ndarray] = {}
    shape = leaf.record.data_shape
    for piece in leaf.pieces:
        if not isinstance(piece, HostPiece) or piece.index is None or piece.parts is not None or piece.shared:
            return None
        blocks[slice_key(piece.index, shape)] = piece.data
    return Tiled(shape, list(blocks.items())) if Tiled.tiles(shape, list(blocks)) else None


class Hashing:
    """`_digested` on a thread of its own, started now: a save without a base needs the
    digests only to commit, so they are computed while the chunks are written (hashing
    and writing each leave the GIL free for most of their time)."""

    def __init__(self, manifest: Manifest, leaves: list[WriteJob]):
        self._result: Manifest | None = None
        self._error: BaseException | None = None
        self.stopping = threading.Event()  # set once the save failed

        def hash_all() -> None:
            try:
                with collector_paused():
                    self._result = digested(manifest, leaves, self.stopping)
                    self._result.leaf_lines()  # encoded now, for the commit
            except BaseException as e:  # raised where the save waits for it
                self._error = e

        # A plain thread, as in `_digested`.
        self._thread = threading.Thread(target=hash_all, name="eqxckpt-hashing")
        self._thread.start()

    def stop(self) -> None:
        """Stop hashing (after the batch in hand) and wait for it: the save failed, and a
        failed save is over only once nothing reads its leaves any more."""
        self.stopping.set()
        self._thread.join()

    def result(self) -> Manifest:
        """The manifest with its digests, once hashed; raises what hashing raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result
