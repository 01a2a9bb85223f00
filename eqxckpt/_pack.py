"""Packed leaves: many small arrays stored as byte ranges of one zarr3 array.

One zarr3 array per leaf costs a directory, two files and a TensorStore open on
every save and load, which is more than the bytes of a small leaf: a tree of
10,000 norms and biases spends its time on them. So when a save holds at least
`PACK_MIN_LEAVES` leaves of at most `PACK_MAX_BYTES` that one process writes
whole, each of those is stored as its little-endian bytes at a 64-byte aligned
``offset`` of one uint8 array, `PACKED_LOCATION`, chunked by `PACK_CHUNK_BYTES`
and crc32c-checked like every array. The manifest still lists every leaf with
its path, keys, shape and dtype; any zarr v3 reader gets one back as
``packed[offset:offset + nbytes].view(dtype).reshape(shape)``.
"""

import bisect
import dataclasses
import sys
from collections.abc import Iterable, Sequence

import numpy as np

from ._chunks import PACK_CHUNK_BYTES, ChunkLayout
from ._convert import aligned_empty
from ._errors import CheckpointError
from ._leaf import ArrayLeaf, Leaf, StoredLeaf
from ._paths import PACK_ALIGNMENT, PACKED_LOCATION
from ._pieces import ChunkWrite, Piece

PACK_MAX_BYTES = 256 * 1024
PACK_MIN_LEAVES = 32
# A load reads runs of adjacent chunks of at most this many bytes.
MAX_RUN_BYTES = 16 * PACK_CHUNK_BYTES


def packable(record: StoredLeaf) -> bool:
    """Whether a leaf written whole by one process is small enough to pack."""
    # Packed bytes are the host's bytes: little-endian hosts only (all that JAX runs on).
    return 0 < record.nbytes <= PACK_MAX_BYTES and sys.byteorder == "little"


def packed_array(leaves: Iterable[Leaf]) -> ArrayLeaf | None:
    """The packed array of a checkpoint's leaves, as the record of a uint8 array just
    long enough to hold them all (in the prefix they name, if any); None if none is packed."""
    packed = [leaf for leaf in leaves if isinstance(leaf, StoredLeaf) and leaf.offset is not None]
    if not packed:
        return None
    end = max(leaf.offset + leaf.nbytes for leaf in packed if leaf.offset is not None)
    # Taken whole from an earlier checkpoint (an incremental save), every packed leaf says where.
    return ArrayLeaf(PACKED_LOCATION, (), (end,), "uint8", "numpy", arrays=packed[0].arrays)


def assign_offsets(records: Sequence[StoredLeaf]) -> list[StoredLeaf]:
    """``records`` packed one after another, each at the next aligned offset."""
    packed, end = [], 0
    for record in records:
        packed.append(dataclasses.replace(record, offset=end))
        end += -(-record.nbytes // PACK_ALIGNMENT) * PACK_ALIGNMENT
    return packed


def member(buffer: np.ndarray, start: int, leaf: StoredLeaf) -> np.ndarray:
    """``leaf``'s stored array, a view into ``buffer`` (bytes of the packed array from ``start``)."""
    assert leaf.offset is not None
    if sys.byteorder != "little":  # the bytes are little-endian; a view would be wrong numbers
        raise CheckpointError(f"Leaf {leaf.path!r} is packed (little-endian bytes); this host is big-endian.")
    raw = buffer[leaf.offset - start : leaf.offset - start + leaf.nbytes]
    return raw.view(np.dtype(leaf.dtype)).reshape(leaf.data_shape)


def unpack(buffer: np.ndarray, start: int, leaves: Sequence[StoredLeaf]) -> list[np.ndarray]:
    """The stored arrays of ``leaves`` from a run of the packed array read into ``buffer``.
    Leaves that fill at least half of the run are views sharing it; a few in a large run
    are copied out, so that they do not keep the rest of it alive."""
    views = [member(buffer, start, leaf) for leaf in leaves]
    if 2 * sum(leaf.nbytes for leaf in leaves) >= buffer.nbytes:
        return views
    copies = []
    for view in views:
        copies.append(aligned_empty(view.shape, view.dtype))  # aligned: XLA adopts it without a copy
        np.copyto(copies[-1], view)
    return copies


class PackedWrite(Piece):
    """The data of the packed leaves, ``(offset, host array)`` in offset order; each chunk
    of the packed array is assembled only when it is written, so packing never holds a
    second copy of all the leaves."""

    def __init__(self, members: list[tuple[int, np.ndarray]]):
        self.members = members
        self._offsets = [offset for offset, _ in members]
        offset, data = members[-1]
        self.nbytes = offset + data.nbytes  # the packed array's length: up to the end of the last member
        self.leaves = len(members)

    def hashed(self) -> list[tuple[int | None, np.ndarray]]:
        return [(offset, data) for offset, data in self.members]

    def assemble(self, start: int, end: int) -> np.ndarray:
        """Bytes ``start:end`` of the packed array; alignment gaps are zeros."""
        out = np.zeros(end - start, np.uint8)
        i = max(0, bisect.bisect_right(self._offsets, start) - 1)
        while i < len(self.members) and self.members[i][0] < end:
            offset, data = self.members[i]
            raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
            low, high = max(offset, start), min(offset + raw.size, end)
            if low < high:
                out[low - start : high - start] = raw[low - offset : high - offset]
            i += 1
        return out

    def chunks(self, layout: ChunkLayout) -> list[ChunkWrite]:
        ends = [offset + data.nbytes for offset, data in self.members]
        writes: list[ChunkWrite] = []
        for key, part in layout.regions():
            [run] = part
            done = bisect.bisect_right(ends, run.stop) - bisect.bisect_right(ends, run.start)
            writes.append((key, part, lambda run=run: self.assemble(run.start, run.stop), done))
        return writes


def read_runs(
    leaves: Sequence[StoredLeaf], length: int, chunk: int = PACK_CHUNK_BYTES
) -> list[tuple[int, int, list[int]]]:
    """Runs of whole chunks (of ``chunk`` bytes) of the packed array (of ``length`` bytes)
    that hold ``leaves``: ``(start, end, indices of the leaves in it)``, each read once."""
    runs: list[tuple[int, int, list[int]]] = []
    longest = max(chunk, MAX_RUN_BYTES // chunk * chunk)
    for i in sorted(range(len(leaves)), key=lambda i: leaves[i].offset or 0):
        leaf = leaves[i]
        assert leaf.offset is not None
        first = leaf.offset // chunk * chunk
        last = min(length, -(-(leaf.offset + leaf.nbytes) // chunk) * chunk)
        if runs and first <= runs[-1][1] and last - runs[-1][0] <= longest:
            start, end, members = runs[-1]
            runs[-1] = (start, max(end, last), members + [i])
        else:
            runs.append((first, last, [i]))
    return runs
