"""What a save writes into one leaf's array, as one interface: a host array (or one
process's shard of it), a leaf copied from another checkpoint, or the packed array of
small leaves (`PackedWrite`, laid out by `_pack.PackedArray`). Each gives its bytes and
its chunks' values; `save` writes every kind the same way."""

import abc
import functools
import math
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from .._chunks import ChunkLayout, Region
from .._classify import leaf_of
from .._distributed import is_multiprocess
from .._dtypes import little_endian
from .._leaf import KeyRecord, Leaf, StoredLeaf, with_storage
from .._read._lazy import LazyArray
from .._read._place import held_blocks, slice_key
from ._pack import PackedArray
from ._shares import WriteShares

if TYPE_CHECKING:  # `_source` reads checkpoints, whose module packs leaves with these pieces
    import jax

    from .._read._source import Source

# A chunk to write: its key, the part of the array it holds, a function producing that
# part's values, or its bytes as a list of byte arrays (run on an I/O thread, just before
# the chunk is written), and how many leaves are complete once it is written (progress).
ChunkWrite = tuple[str, Region, Callable[[], "np.ndarray | list[np.ndarray]"], int]


def one_leaf(writes: list[tuple[str, Region, Callable[[], np.ndarray]]]) -> list[ChunkWrite]:
    """The chunks of a piece holding one leaf: it is complete with the last."""
    return [(key, part, values, int(i == len(writes) - 1)) for i, (key, part, values) in enumerate(writes)]


class Piece(abc.ABC):
    """Data this process writes into one leaf's array."""

    nbytes: int
    leaves: int = 1  # how many leaves it completes (progress)
    whole: np.ndarray | None = None  # the whole leaf in host memory, where this piece is that
    source: "Source | None" = None  # a checkpoint read from, which must stay as it is meanwhile

    def hashed(self) -> list[tuple[int | None, np.ndarray]]:
        """The leaves this piece holds whole in host memory, to digest: ``(offset, data)``,
        the offset of a packed leaf or None for the piece's own leaf."""
        return [] if self.whole is None else [(None, self.whole)]

    def shared_copy(self) -> tuple[tuple[slice, ...] | None, np.ndarray] | None:
        """``(index, data)``: this process's copy of a part that other processes hold too
        (`WriteShares`), whatever it writes of it (all, some, or nothing: kept only for the
        leaf's digest); every copy written from or digested must be equal
        (`_shares.check_copies_agree`). None otherwise."""
        return None

    @abc.abstractmethod
    def chunks(self, layout: ChunkLayout) -> list[ChunkWrite]:
        """Every chunk this piece writes, in C order."""


class HostPiece(Piece):
    """An array in host memory that nothing changes while it is written: the whole leaf
    (``index`` None) or the shard of it at ``index``; of which only the chunks ``parts``
    if given (a shard several processes hold, split among them: `_shares.WriteShares`).
    ``shared``: other processes hold the same part (`shared_copy`)."""

    def __init__(
        self, index: tuple[slice, ...] | None, data: np.ndarray, parts: list[Region] | None = None, shared: bool = False
    ):
        self.index, self.data, self.parts, self.shared = index, data, parts, shared
        itemsize = data.dtype.itemsize
        self.nbytes = (
            data.nbytes if parts is None else sum(math.prod(s.stop - s.start for s in p) for p in parts) * itemsize
        )
        self.whole = data if index is None or all(part == slice(None) for part in index) else None

    def shared_copy(self) -> tuple[tuple[slice, ...] | None, np.ndarray] | None:
        if self.shared:
            return self.index, self.data
        return None

    def chunks(self, layout: ChunkLayout) -> list[ChunkWrite]:
        region = (
            tuple(slice(0, n) for n in layout.shape)
            if self.index is None
            else tuple(slice(a, b) for a, b in slice_key(self.index, layout.shape))
        )

        def values(part: Region) -> np.ndarray:
            return self.data[tuple(slice(p.start - r.start, p.stop - r.start) for p, r in zip(part, region))]

        parts = layout.regions(region) if self.parts is None else [(layout.key(p), p) for p in self.parts]
        return one_leaf([(key, part, lambda part=part: values(part)) for key, part in parts])


class CopiedPiece(Piece):
    """A leaf of another checkpoint (eqxckpt's or a foreign format's), read as its chunks
    are written: an eqxckpt leaf a chunk at a time, a foreign tensor whole, once."""

    def __init__(self, array: LazyArray):
        self.array, self.nbytes, self.source = array, array.nbytes, array.source
        self._lock = threading.Lock()
        self._read: Callable[[Region], np.ndarray] | None = None
        self._left = 0  # chunks whose values are still to be produced

    def _values(self, part: Region) -> np.ndarray:
        with self._lock:  # a piece's chunks may be written concurrently: the reader is made once
            if self._read is None:
                self._read = self.array.part_reader()
            read = self._read
            self._left -= 1
            if not self._left:  # let a tensor read whole go once its last chunk is taken
                self._read = None
        return little_endian(read(part))

    def chunks(self, layout: ChunkLayout) -> list[ChunkWrite]:
        regions = layout.regions()
        self._left = len(regions)
        return one_leaf([(key, part, lambda part=part: self._values(part)) for key, part in regions])


class PackedWrite(Piece):
    """The data of a save's packed leaves: each chunk of the packed array is assembled only
    when it is written, so packing never holds a second copy of all the leaves.

    **Arguments:**

    - `packing`: the packed array being written.
    - `data`: each member's host array, by its path.
    """

    def __init__(self, packing: PackedArray, data: Mapping[str, np.ndarray]):
        assert data.keys() == {m.path for m in packing.members}
        self.packing = packing
        self._data = data
        self.nbytes = packing.length
        self.leaves = len(packing.members)

    def hashed(self) -> list[tuple[int | None, np.ndarray]]:
        return [(m.offset, self._data[m.path]) for m in self.packing.members]

    def gathered(self, start: int, end: int) -> list[np.ndarray]:
        """Bytes ``start:end`` of the packed array, as views of the leaves' own bytes and
        zeros for the alignment gaps between them: written as they are (``writev``), never
        copied into a chunk buffer first."""
        out: list[np.ndarray] = []
        at = start
        for member, own, there in self.packing.pieces(start, end):
            if there.start > at - start:
                out.append(np.zeros(there.start - (at - start), np.uint8))
            out.append(np.ascontiguousarray(self._data[member.path]).reshape(-1).view(np.uint8)[own])
            at = start + there.stop
        if at < end:
            out.append(np.zeros(end - at, np.uint8))
        return [piece for piece in out if piece.size]

    def chunks(self, layout: ChunkLayout) -> list[ChunkWrite]:
        writes: list[ChunkWrite] = []
        for key, part in layout.regions():
            [run] = part
            done = self.packing.ending_in(run.start, run.stop)
            writes.append((key, part, lambda run=run: self.gathered(run.start, run.stop), done))
        return writes


def record_of(path: str, keys: tuple[KeyRecord, ...], value: Any) -> tuple[Leaf, Any]:
    """The manifest record of the leaf ``value`` at ``path``, and the data to write for it
    (a leaf of another checkpoint is copied from there, keeping its digest if it is as stored)."""
    if isinstance(value, LazyArray):
        copied = value.leaf.copied(path, keys, tuple(value.shape), value.dtype, changed=not value.as_stored)
        return copied, value
    return leaf_of(path, keys, value)


def snapshot(
    arrays: list[tuple[StoredLeaf, Any]],
    copy: bool,
    leader: bool,
    multiprocess: bool | None = None,
    own_blocks: bool = False,
    global_leaves: frozenset[int] | None = None,
) -> list[tuple[StoredLeaf, tuple[int, ...] | None, list[Piece]]]:
    """For each array leaf, the shape its chunks must tile (None: whole) and the pieces
    this process writes, in host memory it owns.

    Every element is written by exactly one process. A part of a global array that
    several processes hold is split among them chunk by chunk (`_shares.WriteShares`);
    process 0 also keeps a leaf it holds whole, to digest it, whatever it writes of it.
    Host-local leaves (numpy, fully addressable arrays in a multi-process run) are
    written by process 0 alone. ``copy``: take a private copy of numpy leaves, which the
    caller may mutate afterwards. ``multiprocess``: whether other processes write this
    checkpoint too (None: whether the job has several). ``own_blocks``: a checkpoint of
    this process's own (a local tier's part): a global array it holds only blocks of is
    stored as those blocks, each once (`StoredLeaf.blocks` in the record returned).
    ``global_leaves``: the indices of the global arrays among ``arrays``, as every process
    of a multi-process save agreed (`_shares.global_leaves`); None: those this process
    does not hold whole.
    """
    import jax

    multiprocess = is_multiprocess() if multiprocess is None else multiprocess
    shares = WriteShares(jax.process_count()) if multiprocess else None
    # Each piece: (index, data, chunk parts or None for all, whether other processes hold the part too).
    planned: list[tuple[StoredLeaf, tuple[int, ...] | None, list[tuple[tuple[slice, ...] | None, Any, Any, bool]]]] = []
    for i, (record, value) in enumerate(arrays):
        spans = (
            i in global_leaves
            if global_leaves is not None
            else isinstance(value, jax.Array) and not value.is_fully_addressable
        )
        if isinstance(value, jax.Array) and not spans and isinstance(value.sharding, jax.sharding.SingleDeviceSharding):
            # The common case, without asking for shards (costly per leaf in a tree of many small ones).
            planned.append((record, None, [(None, value, None, False)] if leader or not multiprocess else []))
        elif own_blocks and spans:
            planned.append(_own_blocks(record, value))
        elif shares is not None and spans:
            tile, mine = shares.plan(record, value)
            pieces = [(s.index, s.data, parts, shared) for s, parts, shared in mine]
            if leader and not any(_covers(index) for index, _, _, _ in pieces):
                # Kept whole (and written in part, or not at all) only for its digest.
                pieces += [(s.index, s.data, [], True) for s in value.addressable_shards if _covers(s.index)][:1]
            planned.append((record, tile, pieces))
        elif isinstance(value, jax.Array):
            if multiprocess and not leader:
                shards = []
            else:
                shards = [s for s in value.addressable_shards if s.replica_id == 0]
            whole = len(value.sharding.device_set) == 1
            shard = None if whole else tuple(value.sharding.shard_shape(value.shape))
            planned.append((record, shard, [(None if whole else s.index, s.data, None, False) for s in shards]))
        else:
            planned.append((record, None, [(None, value, None, False)] if leader or not multiprocess else []))
    # Start every device-to-host transfer before waiting on any (a no-op on CPU).
    for _, _, values in planned:
        for _, data, _, _ in values:
            if isinstance(data, jax.Array) and not _on_cpu(data):
                data.copy_to_host_async()
    # A leaf of another checkpoint stays where it is: it is copied chunk by chunk.
    return [
        (
            record,
            shard,
            [
                CopiedPiece(data)
                if isinstance(data, LazyArray)
                else HostPiece(index, host_array(data, copy), parts, shared)
                for index, data, parts, shared in values
            ],
        )
        for record, shard, values in planned
    ]


def _own_blocks(record: StoredLeaf, value: "jax.Array") -> tuple[StoredLeaf, Any, list]:
    """This process's distinct blocks of ``value`` (a global array it holds part of): the
    record with those blocks, the shard shape its chunks tile, and a piece per block."""
    shape = tuple(value.shape)
    by_block = {slice_key(s.index, shape): s for s in reversed(value.addressable_shards)}  # the first of replicas
    blocks = [block for block in held_blocks(value.sharding, shape) if all(a < b for a, b in block)]
    if math.prod(shape) == 0:
        return record, None, [(None, np.zeros(shape, value.dtype), None, False)]
    if blocks == [tuple((0, n) for n in shape)]:  # replicated: this process holds all of it
        return record, None, [(None, by_block[blocks[0]].data, None, False)]
    return (
        with_storage(record, blocks=tuple(blocks)),
        tuple(value.sharding.shard_shape(shape)),
        [(by_block[block].index, by_block[block].data, None, False) for block in blocks],
    )


def _covers(index: tuple[slice, ...]) -> bool:
    return all(part == slice(None) for part in index)


def _on_cpu(array: "jax.Array") -> bool:
    return _all_on_cpu(array.sharding)


@functools.lru_cache(maxsize=1024)  # asked per leaf of a tree of many; they share a few shardings
def _all_on_cpu(sharding: "jax.sharding.Sharding") -> bool:
    return all(d.platform == "cpu" for d in sharding.device_set)


def host_array(value: Any, copy: bool) -> np.ndarray:
    """``value`` in host memory that nothing else will change, little-endian (`little_endian`:
    a piece's bytes are the stored bytes, so a packed leaf and its digest are right too).

    A device array's host copy is fresh. A CPU jax array needs no copy: the
    numpy view holds an external reference to its buffer, which keeps the
    buffer alive and unchanged if the caller deletes the array or donates it
    to a jitted step (XLA then writes the step's output elsewhere), so an async
    save returns without copying it (`tests/test_save.py` checks donation and
    deletion). Numpy arrays are mutable, so an async save copies them.
    """
    import jax

    return little_endian(value, copy=copy and not isinstance(value, jax.Array))
