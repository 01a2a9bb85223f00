"""A save's jobs: each array leaf it writes (`WriteJob`: its record, the shard shape its
chunks tile, its layout, the pieces this process writes), and their digests, computed
before the writes (`digested`, for a save with a base) or beside them (`Hashing`)."""

import dataclasses
import functools
import os
import threading

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


def digested(manifest: Manifest, leaves: list[WriteJob], stop: threading.Event | None = None) -> Manifest:
    """The manifest with the digest of each leaf this process holds whole in host memory
    (a leaf whose shards several processes write gets none; a copied leaf keeps its
    source's). Run where the writes run: off the caller's thread for a background save;
    batches of leaves are hashed on every core (the hash releases the GIL)."""
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
    batches: list[list[tuple[StoredLeaf, np.ndarray | list[np.ndarray] | Tiled]]] = [[]]
    size = 0
    for record, data in whole:
        if size >= DIGEST_BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append((record, data))
        size += record.nbytes
    digests: dict[str, str] = {}
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
                    self._result.leaf_cells()  # encoded now, for the commit
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
