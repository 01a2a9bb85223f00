"""A stored array's chunks: their shapes, their layout, their keys, and the bytes of their files.

Every array eqxckpt stores is zarr v3 with the ``bytes`` codec (little-endian) and
then ``crc32c``. A chunk's file is the chunk's C-order bytes, zero-padded to the
whole chunk shape at the array's edge, followed by the CRC-32C of those bytes
(4 bytes, little-endian). eqxckpt writes and checks these files itself, with the
CPU's CRC instruction (the ``crc32c`` library), instead of through TensorStore's
codec, whose wheels compute the checksum in software, far slower (benchmarks/README.md).
The files are byte for byte what TensorStore writes, so zarr-python and
TensorStore's zarr3 driver still open and verify every checkpoint.
"""

import abc
import dataclasses
import itertools
import json
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from crc32c import crc32c

from ._dtypes import zarr_data_type
from ._errors import CheckpointError
from ._leaf import StoredLeaf
from ._paths import PACKED_LOCATION
from ._read._place import Block

CRC_BYTES = 4
# Chunks are bounded so a partial or resharded read touches little more than
# it needs, and big enough that per-file overhead stays small.
CHUNK_BYTES = 64 * 1024 * 1024
# The packed array of small leaves (see `_pack`) has small chunks: reading one leaf
# lazily, or only the model's, reads little more than those bytes.
PACK_CHUNK_BYTES = 4 * 1024 * 1024
Region = tuple[slice, ...]
# Most chunks a leaf's array may have: at most one per MIN_MEAN_CHUNK_BYTES of it, or
# MIN_CHUNK_LIMIT, whichever is more. Each chunk costs a file, a read and a task whatever
# its size; eqxckpt's own layouts have 64 MiB chunks, or one (or a few) per shard of a
# save sharded over at most MIN_CHUNK_LIMIT devices. A crafted zarr.json could otherwise
# declare a 4 MiB leaf in a million one-element chunks.
MIN_CHUNK_LIMIT = 1 << 16
MIN_MEAN_CHUNK_BYTES = 4096
# Along a sharded dimension a chunk divides the shard; where the shard's length has no
# divisor within this factor below the budget (a prime number of rows), the chunk is the
# smallest divisor above it instead, the dimensions after it cut to fit: a chunk may then
# exceed its budget, and a reader accepts chunks of up to MAX_CHUNK_BYTES.
MAX_CHUNK_FACTOR = 4
MAX_CHUNK_BYTES = MAX_CHUNK_FACTOR * CHUNK_BYTES


def chunk_budget(path: str) -> int:
    """The most bytes a chunk of the array at ``path`` holds."""
    return PACK_CHUNK_BYTES if path == PACKED_LOCATION else CHUNK_BYTES


def chunk_shape(
    shape: tuple[int, ...], itemsize: int, shard: tuple[int, ...] | None = None, budget: int | None = None
) -> list[int]:
    """A C-contiguous chunk shape of at most ``budget`` bytes that tiles ``shard``.

    Trailing dimensions are kept whole while they fit, so each chunk is one
    contiguous run of the array and a full read is a few large sequential reads.
    Along a sharded dimension the chunk divides the shard exactly, so no chunk
    straddles two writers' shards (two writers on one chunk would lose data). Where
    the shard's length has no divisor near the budget (a prime), the chunk takes the
    smallest divisor above it along that dimension and the dimensions after it are
    cut to fit (`MAX_CHUNK_FACTOR`): a shard in a few chunks, never in one per row.

    ```python
    chunk_shape((1024, 1024), 4, budget=1 << 20)                    # [256, 1024]
    chunk_shape((1024, 1024), 4, shard=(512, 1024), budget=3 << 20)  # [512, 1024]
    chunk_shape((262, 256), 4, shard=(131, 256), budget=1 << 16)     # [131, 86]
    ```
    """
    shard = tuple(shape) if shard is None else tuple(shard)
    elements = max(1, (CHUNK_BYTES if budget is None else budget) // max(1, itemsize))
    return _chunk(tuple(shape), shard, elements, balanced=False)


def _chunk(
    shape: tuple[int, ...], shard: tuple[int, ...], elements: int, balanced: bool, most: int | None = None
) -> list[int]:
    """`chunk_shape` of ``elements`` elements, or up to ``most`` (`MAX_CHUNK_FACTOR` times
    as many) where a shard's length has no divisor near the budget; ``balanced``: an
    unsharded dimension cut into chunks of equal size (no chunk of a few elements at its end)."""
    most = MAX_CHUNK_FACTOR * elements if most is None else most
    chunk: list[int] = []
    budget = elements
    for at in reversed(range(len(shape))):
        dim, part = shape[at], max(1, shard[at])
        if part <= elements:
            chunk.append(part)
            elements //= part
            continue
        if part == dim:  # not sharded: any size
            size = -(-dim // -(-dim // elements)) if balanced else elements
        else:
            size = _largest_divisor(part, elements)
            if size * MAX_CHUNK_FACTOR < elements:  # no divisor near the budget
                above = _smallest_divisor_above(part, elements)
                inner = _chunk(shape[at + 1 :], shard[at + 1 :], max(1, budget // above), True, most // above)
                # Taken only where it cuts the shard into fewer chunks (both dimensions may be prime).
                if above * math.prod(inner) <= most and _per_shard(shard[at:], [above, *inner]) < _per_shard(
                    shard[at:], [size, *chunk[::-1]]
                ):
                    size, chunk = above, inner[::-1]
        chunk.append(size)
        chunk.extend([1] * at)
        break
    return chunk[::-1]


def _per_shard(shard: Sequence[int], chunk: Sequence[int]) -> int:
    """How many chunks of ``chunk`` a shard of ``shard`` is cut into."""
    return math.prod(-(-max(1, p) // c) for p, c in zip(shard, chunk))


def _largest_divisor(n: int, at_most: int) -> int:
    best = 1
    for d in range(1, int(n**0.5) + 1):
        if n % d == 0:
            for candidate in (d, n // d):
                if best < candidate <= at_most:
                    best = candidate
    return best


def _smallest_divisor_above(n: int, at_least: int) -> int:
    best = n
    for d in range(1, int(n**0.5) + 1):
        if n % d == 0:
            for candidate in (d, n // d):
                if at_least <= candidate < best:
                    best = candidate
    return best


def chunk_regions(chunk: Sequence[int], region: Sequence[slice]) -> list[tuple[slice, ...]]:
    """The part of ``region`` in each chunk it covers, in C order. ``region`` (slices with
    explicit bounds) starts on chunk boundaries: a whole array, a shard, a run of chunks.

    ```python
    chunk_regions([2, 4], [slice(0, 3), slice(0, 4)])  # rows 0-1, then row 2
    ```
    """
    if any(s.start >= s.stop for s in region):
        return []  # empty: `product` would first list every start along the other dimensions
    starts = itertools.product(*(range(s.start, s.stop, c) for s, c in zip(region, chunk)))
    return [tuple(slice(a, min(a + c, s.stop)) for a, c, s in zip(first, chunk, region)) for first in starts]


class ChunkFiles(abc.ABC):
    """Where an array's chunk files are read and written: plain files on a local disk,
    TensorStore's kvstore on object stores. Keys are relative to the checkpoint's arrays
    (``model/w/c/0/0``). `read` and `write` block; `reading` and `writing` are the same as
    coroutines for the I/O threads (`_window`), which an object store's requests in flight
    hold no thread of."""

    @abc.abstractmethod
    def write(self, key: str, pieces: Sequence[np.ndarray]) -> None:
        """Write the file ``key`` holding ``pieces`` (bytes), one after another."""

    @abc.abstractmethod
    def read(self, key: str, into: Sequence[np.ndarray], at: int = 0, size: int | None = None) -> None:
        """Fill ``into`` (writable byte buffers) with the bytes of the file ``key`` from
        offset ``at`` on (a range of it: a slab of a large chunk). The file must hold
        exactly ``size`` bytes (by default, ``at`` plus the buffers' total); a
        `ChunkFileError` says why not."""

    async def reading(self, key: str, into: Sequence[np.ndarray], at: int = 0, size: int | None = None) -> None:
        """`read`, awaiting its requests (`_window.done`) where they go over a network; a
        local disk's read runs at once: it is fast, and blocks in the kernel, not on a future."""
        self.read(key, into, at, size)

    async def writing(self, key: str, pieces: Sequence[np.ndarray]) -> None:
        """`write`, as `reading` is `read`. ``pieces`` stay unchanged until it returns."""
        self.write(key, pieces)

    async def reading_ranges(self, key: str, ranges: Iterator[tuple[int, Sequence[np.ndarray]]], size: int) -> None:
        """Fill each ``(at, into)`` of ``ranges`` in turn with the bytes of the file ``key``
        (which must hold ``size`` bytes) from ``at`` on (`reading`), asking for the next
        range only once the one before is read: ``ranges`` may reuse its buffers. A file
        on a disk is opened once for all of them, so every range is of the same file."""
        for at, into in ranges:
            await self.reading(key, into, at, size)


class ChunkFileError(Exception):
    """A chunk file that is missing, of the wrong size, or fails its checksum; the caller
    names the leaf (`_storage.corrupt`)."""


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """How a leaf's array is chunked: planned once from its record when it is saved,
    and taken from its validated ``zarr.json`` when it is read.

    ```python
    layout = ChunkLayout((5, 3), np.dtype("float32"), (2, 3))
    [key for key, _ in layout.regions()]  # ['c/0/0', 'c/1/0', 'c/2/0']
    ```
    """

    shape: tuple[int, ...]
    dtype: np.dtype
    chunk: tuple[int, ...]
    # A part's array (`StoredLeaf.blocks`): only the chunks of these blocks exist.
    held: tuple[Block, ...] | None = None

    def __post_init__(self) -> None:
        if sys.byteorder != "little":  # chunk bytes are the host's bytes
            raise CheckpointError("eqxckpt reads and writes little-endian arrays; this host is big-endian.")

    @classmethod
    def planned(cls, record: StoredLeaf, shard: tuple[int, ...] | None = None) -> "ChunkLayout":
        """The layout a save gives ``record``'s array, whose chunks tile ``shard`` (None: whole)."""
        dtype = np.dtype(record.dtype)
        chunk = chunk_shape(record.data_shape, dtype.itemsize, shard, chunk_budget(record.path))
        return cls(record.data_shape, dtype, tuple(chunk), record.blocks)

    @classmethod
    def stored(cls, record: StoredLeaf, metadata: dict[str, Any]) -> "ChunkLayout":
        """The layout of ``record``'s array from its validated ``zarr.json``."""
        chunk = metadata["chunk_grid"]["configuration"]["chunk_shape"]
        return cls(record.data_shape, np.dtype(record.dtype), tuple(chunk), record.blocks)

    @property
    def chunk_nbytes(self) -> int:
        return math.prod(self.chunk) * self.dtype.itemsize

    @property
    def count(self) -> int:
        """How many chunks (files) the array has."""
        if self.held is not None:
            return sum(math.prod(-(-(b - a) // c) for (a, b), c in zip(block, self.chunk)) for block in self.held)
        return math.prod(-(-n // c) for n, c in zip(self.shape, self.chunk))

    def aligned(self) -> bool:
        """Whether every held block is made of whole chunks (as a save lays a part out)."""
        return self.held is None or all(
            a % c == 0 and (b % c == 0 or b == n)
            for block in self.held
            for (a, b), c, n in zip(block, self.chunk, self.shape)
        )

    def held_regions(self) -> list[Region]:
        """The regions whose chunks exist: the held blocks, or the whole array."""
        if self.held is None:
            return [tuple(slice(0, n) for n in self.shape)]
        return [tuple(slice(a, b) for a, b in block) for block in self.held]

    def slabs(self) -> list[tuple[int, Region]]:
        """The array's rows of chunks, in order, each with its block (0 but in a part, whose
        held blocks come one after another): each holds a run of its block's C-order bytes.

        ```python
        ChunkLayout((4, 3), (2, 3), np.dtype("float32")).slabs()[1]  # (0, (slice(2, 4), slice(0, 3)))
        ```
        """
        if not self.shape or 0 in self.shape:
            return [(0, tuple(slice(0, n) for n in self.shape))]
        rows = self.chunk[0]
        return [
            (block, (slice(start, min(start + rows, first.stop)), *rest))
            for block, (first, *rest) in enumerate(self.held_regions())
            for start in range(first.start, first.stop, rows)
        ]

    def refusal(self) -> str | None:
        """Why a reader refuses this layout (what a ``zarr.json`` declaring it "has" or
        "does"), or None: the one check a load applies and a save applies before it
        writes, so that no save writes what a load refuses."""
        if self.chunk_nbytes > MAX_CHUNK_BYTES:
            return f"has chunks of {list(self.chunk)} (over {MAX_CHUNK_BYTES} bytes)"
        if not self.aligned():
            return f"has chunks of {list(self.chunk)}, which do not tile the blocks the manifest says this part holds"
        if self.count > self.max_count:  # each chunk costs a file, a read and a task, whatever its size
            return (
                f"splits its {math.prod(self.shape) * self.dtype.itemsize} bytes into {self.count} chunks of "
                f"{list(self.chunk)} (at most {self.max_count} are accepted: one per 4 KiB, or 65536)"
            )
        return None

    @property
    def max_count(self) -> int:
        """The most chunks a reader accepts for this array (`MIN_CHUNK_LIMIT`)."""
        return max(MIN_CHUNK_LIMIT, math.prod(self.shape) * self.dtype.itemsize // MIN_MEAN_CHUNK_BYTES)

    def metadata(self) -> dict[str, Any]:
        """The array's ``zarr.json``, as TensorStore's zarr3 driver writes it."""
        name = zarr_data_type(self.dtype.name)
        endian = {} if self.dtype.itemsize == 1 else {"configuration": {"endian": "little"}}
        return {
            "chunk_grid": {"configuration": {"chunk_shape": list(self.chunk)}, "name": "regular"},
            "chunk_key_encoding": {"name": "default"},
            "codecs": [{**endian, "name": "bytes"}, {"name": "crc32c"}],
            "data_type": name,
            "fill_value": _zero(name),
            "node_type": "array",
            "shape": list(self.shape),
            "zarr_format": 3,
        }

    def zarr_json(self) -> bytes:
        return json.dumps(self.metadata(), sort_keys=True, separators=(",", ":")).encode()

    def regions(self, region: Region | None = None) -> list[tuple[str, Region]]:
        """``(key, part)`` of every chunk ``region`` covers (None: the whole array; else it
        starts on chunk boundaries), with the part of ``region`` in it, in C order."""
        if 0 in self.shape:
            return []
        regions = self.held_regions() if region is None else [region]
        return [(self.key(part), part) for region in regions for part in chunk_regions(self.chunk, region)]

    def parts(self, box: Sequence[range]) -> Iterator[tuple[str, Region, Region, Region]]:
        """For every chunk holding elements of ``box`` (a range of indices with a positive
        step per dimension), in C order: its key, its part of the array (what its file
        holds, as `read_chunk` takes it), which of those elements ``box`` selects (relative
        to the part) and where they go in an array shaped like ``box``. Lazily: a read
        stops at the first bad chunk without listing the others.

        ```python
        layout = ChunkLayout((10,), np.dtype("float32"), (4,))
        [(key, take, put) for key, _, take, put in layout.parts([range(3, 10, 3)])]
        # [('c/0', (slice(3, 4, 3),), (slice(0, 1),)), ('c/1', (slice(2, 4, 3),), (slice(1, 2),)),
        #  ('c/2', (slice(1, 2, 3),), (slice(2, 3),))]
        ```
        """
        if not all(len(r) for r in box):
            return  # selects nothing: the other dimensions' chunks (any number of them) are not listed
        dims = []
        for r, c, n in zip(box, self.chunk, self.shape):
            entries = []
            for k in range(r[0] // c, r[-1] // c + 1):
                start, stop = k * c, min(n, k * c + c)
                first = r.start + max(0, -(-(start - r.start) // r.step)) * r.step  # first index in the chunk
                end = min(stop, r.stop)
                if first < end:
                    at = (first - r.start) // r.step
                    taken = slice(first - start, end - start, r.step)
                    entries.append((slice(start, stop), taken, slice(at, at + len(range(first, end, r.step)))))
            dims.append(entries)
        for combo in itertools.product(*dims):
            part = tuple(entry[0] for entry in combo)
            yield self.key(part), part, tuple(entry[1] for entry in combo), tuple(entry[2] for entry in combo)

    def key(self, part: Region) -> str:
        """The key of the chunk holding ``part``: ``c/i/j`` (``c`` for a scalar)."""
        return "/".join(["c", *(str(s.start // c) for s, c in zip(part, self.chunk))])

    def files(self, path: str) -> dict[str, int]:
        """``{key: size}`` of every chunk file of the array at ``path``."""
        return {f"{path}/{key}": self.chunk_nbytes + CRC_BYTES for key, _ in self.regions()}


def _zero(name: str) -> Any:
    """Zero of the data type ``name`` as TensorStore writes a ``fill_value`` (``0.0`` for
    bfloat16 and float8 too)."""
    if name == "bool":
        return False
    if name.startswith("complex"):
        return [0.0, 0.0]
    return 0.0 if "float" in name else 0


def leads_chunk(extent: Sequence[int], chunk: Sequence[int]) -> bool:
    """Whether a part of ``extent`` at a chunk's origin is the first bytes of the chunk:
    whole in every dimension after the first one it spans more than one element of."""
    for d, n in enumerate(extent):
        if n > 1:
            return tuple(extent[d + 1 :]) == tuple(chunk[d + 1 :])
    return True


def bytes_of(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


def crc_of(pieces: Sequence[np.ndarray]) -> int:
    value = 0
    for piece in pieces:
        value = crc32c(piece.data, value)
    return value


def encode(layout: ChunkLayout, part: Region, data: np.ndarray | list[np.ndarray]) -> list[np.ndarray]:
    """The pieces of the file of the chunk holding ``part``, whose values are ``data``:
    views of ``data`` where its bytes lead the chunk, then the padding and the checksum.
    ``data`` may also be a list of byte arrays (uint8, one dimension): in order, the bytes
    of a ``part`` that leads its chunk, written as they are (a packed chunk's leaves)."""
    extent = tuple(s.stop - s.start for s in part)
    if isinstance(data, list):
        assert leads_chunk(extent, layout.chunk) and all(piece.dtype == np.uint8 and piece.ndim == 1 for piece in data)
        body = data
    else:
        if data.dtype != layout.dtype:  # pieces give little-endian values of the leaf's dtype; a net
            data = data.astype(layout.dtype)
        if leads_chunk(extent, layout.chunk):
            body = [bytes_of(np.ascontiguousarray(data))]
        else:
            whole = np.zeros(layout.chunk, layout.dtype)
            whole[tuple(slice(0, n) for n in extent)] = data
            body = [bytes_of(whole)]
    size = sum(piece.size for piece in body)
    assert size <= layout.chunk_nbytes
    pieces = [piece for piece in [*body, np.zeros(layout.chunk_nbytes - size, np.uint8)] if piece.size]
    return [*pieces, np.frombuffer(crc_of(pieces).to_bytes(CRC_BYTES, "little"), np.uint8)]


def chunk_file_sound(raw: bytes) -> bool:
    """Whether ``raw`` (a whole chunk file: its bytes, then their CRC-32C) passes its checksum.

    ```python
    chunk_file_sound(path.read_bytes())  # False after a flipped bit or a truncation
    ```
    """
    return len(raw) >= 4 and crc32c(raw[:-4]) == int.from_bytes(raw[-4:], "little")
