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
import json
import sys
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from .._chunks import PACK_CHUNK_BYTES
from .._errors import CheckpointError, ManifestError
from .._formats._convert import aligned_empty
from .._leaf import ArrayLeaf, Leaf, StoredLeaf, check_bool_bytes, with_storage
from .._paths import PACK_ALIGNMENT, PACKED_LOCATION

PACK_MAX_BYTES = 256 * 1024
PACK_MIN_LEAVES = 32
# A load reads runs of adjacent chunks of at most this many bytes.
MAX_RUN_BYTES = 16 * PACK_CHUNK_BYTES


def packable(record: StoredLeaf) -> bool:
    """Whether a leaf written whole by one process is small enough to pack."""
    # Packed bytes are the host's bytes: little-endian hosts only (all that JAX runs on).
    return 0 < record.nbytes <= PACK_MAX_BYTES and sys.byteorder == "little"


def assign_offsets(records: Sequence[StoredLeaf]) -> list[StoredLeaf]:
    """``records`` packed one after another, each at the next aligned offset."""
    packed, end = [], 0
    for record in records:
        packed.append(with_storage(record, offset=end))
        end += -(-record.nbytes // PACK_ALIGNMENT) * PACK_ALIGNMENT
    return packed


class PackedArray:
    """The packed array of a checkpoint (or of a save): its members, the packed leaves,
    each at its offset, and every question about where their bytes are. The one owner
    of the offsets: a load's runs of chunks, verify's leaves in a chunk, a save's
    chunks and incremental reuse all ask it.

    **Arguments:**

    - `members`: the packed leaves (each with an ``offset``), in any order.

    ```python
    packing = PackedArray.of(eqxckpt.open("ckpt").stored.manifest.leaves)
    [leaf.path for leaf, _, _ in packing.pieces(0, 4096)]  # the leaves in the first 4 KiB
    ```
    """

    def __init__(self, members: Iterable[StoredLeaf]):
        # In offset order; once `check_ranges` holds, the ends are in order too.
        self.members = sorted(members, key=lambda m: (m.offset or 0, (m.offset or 0) + m.nbytes, m.path))
        assert self.members and all(m.offset is not None for m in self.members)
        self._starts = [m.offset or 0 for m in self.members]
        self._ends = [start + m.nbytes for start, m in zip(self._starts, self.members)]
        self.length = max(self._ends)  # just long enough to hold them all
        # Taken whole from an earlier checkpoint (an incremental save), every member says where.
        self.record = ArrayLeaf(PACKED_LOCATION, (), (self.length,), "uint8", "numpy", arrays=self.members[0].arrays)

    @classmethod
    def of(cls, leaves: Iterable[Leaf]) -> "PackedArray | None":
        """The packed array of a checkpoint's leaves; None if none is packed.

        **Arguments:**

        - `leaves`: a manifest's leaves (or any of them).

        **Returns:** a `PackedArray` of those with an ``offset``, or None.

        ```python
        PackedArray.of(manifest.leaves)
        ```
        """
        members = [leaf for leaf in leaves if isinstance(leaf, StoredLeaf) and leaf.offset is not None]
        return cls(members) if members else None

    def check_ranges(self, where: str) -> None:
        """Raise `ManifestError` if two members share bytes: they would load as arrays
        sharing memory (writing one changes the other), which no save produces. (Each
        offset is aligned and non-negative (`StoredLeaf`), and the array is just long enough
        for them, which its ``zarr.json`` must say.)

        **Arguments:**

        - `where`: the checkpoint, as the error names it.

        ```python
        PackedArray.of(records).check_ranges("ckpt")
        ```
        """
        starts = np.array(self._starts, np.int64)
        self.check_spans(starts, np.array(self._ends, np.int64), [m.path for m in self.members], where)

    @staticmethod
    def check_spans(starts: np.ndarray, ends: np.ndarray, paths: Sequence[str], where: str) -> None:
        """Raise `ManifestError` if two of the byte ranges ``starts[i]:ends[i]`` (the
        members named ``paths``, in any order) overlap: one sort, or none where they are
        in order of offset, as a save writes them. What `check_ranges` and a leaf table's
        reader ask, before any member's record is made.

        **Arguments:**

        - `starts`, `ends`: int64 arrays, each end at least its start.
        - `paths`: the members' paths, for the error; `where`: the checkpoint.

        ```python
        PackedArray.check_spans(np.array([0, 64]), np.array([16, 80]), ["a", "b"], "ckpt")
        ```
        """
        order = np.arange(len(starts)) if (starts[1:] > starts[:-1]).all() else np.lexsort((ends, starts))
        overlap = np.flatnonzero(starts[order][1:] < ends[order][:-1])
        if overlap.size:
            first, second = int(order[overlap[0]]), int(order[overlap[0] + 1])
            raise ManifestError(
                f"The manifest of {where} places packed leaves {paths[first]!r} and {paths[second]!r} in "
                f"overlapping bytes of {PACKED_LOCATION!r} (one ends at {int(ends[first])}, the other starts at "
                f"{int(starts[second])}). eqxckpt never writes that: the manifest is corrupt or crafted."
            )

    def pieces(self, start: int, end: int) -> Iterator[tuple[StoredLeaf, slice, slice]]:
        """The members with bytes in ``[start, end)`` of the packed array, in offset order,
        each with the slice of its own bytes there and the slice of ``[start, end)`` they fill.

        **Arguments:**

        - `start`, `end`: a byte range of the packed array.

        **Returns:** ``(member, its bytes, where they are from start)`` for each.

        ```python
        for leaf, own, there in packing.pieces(start, start + data.size):
            digests[leaf.path].update(data[there])
        ```
        """
        # Members ending after start and starting before end (an empty one strictly inside).
        for i in range(bisect.bisect_right(self._ends, start), bisect.bisect_left(self._starts, end)):
            offset = self._starts[i]
            low, high = max(offset, start), min(self._ends[i], end)
            yield self.members[i], slice(low - offset, high - offset), slice(low - start, high - start)

    def checked_pieces(
        self, start: int, data: np.ndarray
    ) -> Iterator[tuple[StoredLeaf, np.ndarray, CheckpointError | None]]:
        """The members' bytes in ``data`` (bytes ``start:start + data.size`` of the packed
        array, as read), each checked as its dtype's: a bool member's must all be 0 or 1
        (`check_bool_bytes`). What `verify` reads the packed array through.

        **Arguments:**

        - `start`: where ``data`` begins in the packed array.
        - `data`: those bytes (uint8).

        **Returns:** ``(member, its bytes there, why they are damaged or None)`` for each
        member with bytes in ``data``, in offset order.

        ```python
        for leaf, piece, problem in packing.checked_pieces(start, data):
            digests[leaf.path].update(piece)
        ```
        """
        for member, _, there in self.pieces(start, start + data.size):
            piece, problem = data[there], None
            if member.dtype == "bool":
                try:
                    check_bool_bytes(piece.view(np.bool_), member.path)
                except CheckpointError as e:
                    problem = e
            yield member, piece, problem

    def same_bytes_as(self, other: "PackedArray") -> bool:
        """Whether ``other`` packs the same leaves, with the same digests, at the same
        offsets: then the two packed arrays are the same bytes (what incremental reuse asks).

        **Arguments:**

        - `other`: another checkpoint's packed array.

        **Returns:** True if they hold the same bytes; False if unknown (a member has no digest).

        ```python
        new.same_bytes_as(base.stored.packing)
        ```
        """

        def packing(array: PackedArray) -> set[tuple[object, ...]] | None:
            if any(m.digest is None for m in array.members):
                return None
            return {(m.path, m.offset, m.digest, json.dumps(m.digest_fields())) for m in array.members}

        found = packing(self)
        return found is not None and found == packing(other)

    def runs(self, leaves: Sequence[StoredLeaf], chunk: int = PACK_CHUNK_BYTES) -> list[tuple[int, int, list[int]]]:
        """Runs of whole chunks (of ``chunk`` bytes) of the packed array that hold ``leaves``
        (some members): ``(start, end, indices of the leaves in it)``, each read once.

        **Arguments:**

        - `leaves`: the members to read.
        - `chunk`: the packed array's chunk size.

        **Returns:** the runs, in offset order, each at most `MAX_RUN_BYTES` (or one chunk).

        ```python
        for start, end, indices in packing.runs(wanted, layout.chunk[0]): ...
        ```
        """
        runs: list[tuple[int, int, list[int]]] = []
        longest = max(chunk, MAX_RUN_BYTES // chunk * chunk)
        for i in sorted(range(len(leaves)), key=lambda i: leaves[i].offset or 0):
            leaf = leaves[i]
            assert leaf.offset is not None
            first = leaf.offset // chunk * chunk
            last = min(self.length, -(-(leaf.offset + leaf.nbytes) // chunk) * chunk)
            if runs and first <= runs[-1][1] and last - runs[-1][0] <= longest:
                start, end, members = runs[-1]
                runs[-1] = (start, max(end, last), members + [i])
            else:
                runs.append((first, last, [i]))
        return runs

    def ending_in(self, start: int, end: int) -> int:
        """How many members' last bytes are in ``[start, end)``: those done once it is written."""
        return bisect.bisect_right(self._ends, end) - bisect.bisect_right(self._ends, start)

    def unpack(self, buffer: np.ndarray, start: int, leaves: Sequence[StoredLeaf]) -> list[np.ndarray]:
        """The stored arrays of ``leaves`` (members) from a run of the packed array read into
        ``buffer`` (its bytes from ``start``). Leaves that fill at least half of the run are
        views sharing it; a few in a large run are copied out, so that they do not keep the
        rest of it alive.

        **Arguments:**

        - `buffer`: bytes ``start:start + buffer.size`` of the packed array.
        - `start`: where they begin.
        - `leaves`: members whose bytes are all in ``buffer``.

        **Returns:** each leaf's stored array (its ``data_shape`` and dtype).

        ```python
        packing.unpack(buffer, start, [leaves[i] for i in indices])
        ```
        """
        if sys.byteorder != "little":  # the bytes are little-endian; a view would be wrong numbers
            raise CheckpointError(f"Leaf {leaves[0].path!r} is packed (little-endian bytes); this host is big-endian.")
        views = []
        for leaf in leaves:
            assert leaf.offset is not None
            raw = buffer[leaf.offset - start : leaf.offset - start + leaf.nbytes]
            views.append(raw.view(np.dtype(leaf.dtype)).reshape(leaf.data_shape))
        if 2 * sum(leaf.nbytes for leaf in leaves) >= buffer.nbytes:
            return views
        copies = []
        for view in views:
            copies.append(aligned_empty(view.shape, view.dtype))  # aligned: XLA adopts it without a copy
            np.copyto(copies[-1], view)
        return copies
