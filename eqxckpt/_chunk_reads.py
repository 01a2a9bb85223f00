"""Reading a chunk file into the buffers of what a restore, a lazy read or a check wants
of it: straight into them where its bytes lead the chunk or fall in a few runs
(`read_chunk`, `read_scattered`), else a slab at a time (`read_slabs`), every file's
CRC-32C checked. The files' layout and bytes are `_chunks`'s."""

import itertools
import math
from collections.abc import Iterator, Sequence

import numpy as np
from crc32c import crc32c

from ._chunks import CRC_BYTES, ChunkFileError, ChunkFiles, ChunkLayout, Region, bytes_of, crc_of, leads_chunk
from ._window import host_memory_budget


async def read_chunk(files: ChunkFiles, key: str, layout: ChunkLayout, part: Region, out: np.ndarray) -> None:
    """Read the chunk file ``key``, check its checksum, and put its values for ``part``
    into ``out`` (shaped like ``part``): straight into ``out`` when those are the file's
    first bytes and ``out`` is contiguous, else a slab at a time (`read_slabs`)."""
    extent = tuple(s.stop - s.start for s in part)
    if not (leads_chunk(extent, layout.chunk) and out.flags.c_contiguous):
        await read_slabs(files, key, layout, [(tuple(slice(0, n) for n in extent), out)])
        return
    stored = np.empty(CRC_BYTES, np.uint8)
    body = bytes_of(out)
    pieces = [body, np.empty(layout.chunk_nbytes - body.size, np.uint8)]
    pieces = [piece for piece in pieces if piece.size]
    await files.reading(key, [*pieces, stored])
    _check(key, crc_of(pieces), stored)


async def read_into(
    files: ChunkFiles, key: str, layout: ChunkLayout, part: Region, take: Region, into: np.ndarray
) -> None:
    """Read the chunk file ``key`` holding ``part`` (see `ChunkLayout.parts`), check it, and
    put its elements ``take`` into ``into``: straight in when that is the whole part, else
    a slab at a time (`read_slabs`)."""
    extent = tuple(s.stop - s.start for s in part)
    if all(t.start == 0 and t.stop == n and t.step in (None, 1) for t, n in zip(take, extent)):
        await read_chunk(files, key, layout, part, into)
        return
    await read_slabs(files, key, layout, [(take, into)])


async def read_scattered(
    files: ChunkFiles, key: str, layout: ChunkLayout, part: Region, targets: list[tuple[Region, np.ndarray]]
) -> None:
    """Read the chunk file ``key`` holding ``part``, check it, and put each ``(take, into)``
    of ``targets`` (disjoint selections of the part, relative to it) into ``into``.

    Where the targets split the chunk along one dimension and take whole what follows it
    (rows of a leaf split by rows or by columns between devices), the file is read straight
    into their buffers, a run each, with no buffer of the whole chunk: a sharded restore
    then holds no more than its window. Otherwise a slab at a time (`read_slabs`)."""
    pieces = _scatter(layout, part, targets)
    if pieces is None:
        await read_slabs(files, key, layout, targets)
        return
    stored = np.empty(CRC_BYTES, np.uint8)
    await files.reading(key, [*pieces, stored])
    _check(key, crc_of(pieces), stored)


# Most bytes of a chunk file read at a time where its values cannot go straight into their
# buffers (and at most the host memory budget, but never less than `MIN_SLAB_BYTES`: a
# tiny budget would otherwise read a chunk a byte at a time): what such a read holds
# beyond its result, however large the chunk.
SLAB_BYTES = 4 << 20
MIN_SLAB_BYTES = 1 << 20


async def read_slabs(
    files: ChunkFiles, key: str, layout: ChunkLayout, targets: Sequence[tuple[Region, np.ndarray]]
) -> None:
    """Read the chunk file ``key`` a slab at a time and put each ``(take, into)`` of
    ``targets`` (selections relative to the chunk's origin, steps allowed) into ``into``
    as its slabs pass, carrying the file's checksum from slab to slab and checking it at
    the end. A slab is consecutive indices of one dimension, all that follows it whole
    and one index of each dimension before it (the first dimension whose one index fits
    the slab's bytes): contiguous bytes of the file, one ranged read each, through one
    open file where the files are on a disk (`ChunkFiles.reading_ranges`). Values reach
    ``into`` before the checksum is checked: a caller whose read raises discards them."""
    chunk, itemsize = layout.chunk, layout.dtype.itemsize
    cap = max(MIN_SLAB_BYTES, min(SLAB_BYTES, host_memory_budget()))
    split = next((d for d in range(len(chunk)) if math.prod(chunk[d + 1 :]) * itemsize <= cap), 0)
    rows = chunk[split] if chunk else 1
    row_bytes = math.prod(chunk[split + 1 :]) * itemsize
    per_slab = max(1, min(rows, cap // row_bytes))
    slab = np.empty((per_slab, *chunk[split + 1 :]), layout.dtype)
    stored = np.empty(CRC_BYTES, np.uint8)
    prefixes = list(itertools.product(*(range(n) for n in chunk[:split])))
    # The slabs tile the chunk as chunks tile an array: which elements each target takes
    # of each slab, and where they go, is `ChunkLayout.parts` of the slabs' grid.
    grid = ChunkLayout(chunk, layout.dtype, (*(1,) * split, per_slab, *chunk[split + 1 :]) if chunk else ())
    wanted = [
        (into, {slab_key: (take, put) for slab_key, _, take, put in grid.parts(_ranges(selection))})
        for selection, into in targets
    ]
    tail = [slice(0, n) for n in chunk[split + 1 :]]
    crc = [0]

    def ranges() -> Iterator[tuple[int, list[np.ndarray]]]:
        # Each slab is put in place and added to the checksum once the reader asks for the
        # next one: after it was read.
        for n, prefix in enumerate(prefixes):
            for first in range(0, rows, per_slab):
                count = min(per_slab, rows - first)
                body = bytes_of(slab[:count])
                last = n == len(prefixes) - 1 and first + count == rows
                yield (n * rows + first) * row_bytes, [body, stored] if last else [body]
                crc[0] = crc32c(body.data, crc[0])
                slab_key = grid.key((*(slice(i, i + 1) for i in prefix), slice(first, first + count), *tail))
                for into, parts in wanted:
                    if slab_key in parts:
                        take, put = parts[slab_key]
                        into[put] = slab[:count][take[split:]] if chunk else slab[0]

    await files.reading_ranges(key, ranges(), layout.chunk_nbytes + CRC_BYTES)
    _check(key, crc[0], stored)


def _ranges(selection: Region) -> list[range]:
    """A selection (slices with a stop, as targets give them) as `ChunkLayout.parts` takes it."""
    return [range(s.start or 0, s.stop, s.step or 1) for s in selection]


def _scatter(layout: ChunkLayout, part: Region, targets: list[tuple[Region, np.ndarray]]) -> list[np.ndarray] | None:
    """The byte runs of the chunk file, in order, as views of the targets' buffers (and
    scratch for padding and bytes no target takes); None where that is not a few runs."""
    extent = tuple(s.stop - s.start for s in part)
    rank = len(extent)
    if not rank or not targets:
        return None
    # The dimension the targets split: the last along which any take is not whole.
    split = max(
        (d for take, _ in targets for d in range(rank) if (take[d].start, take[d].stop) != (0, extent[d])), default=0
    )
    if any(take[d].step not in (None, 1) for take, _ in targets for d in range(rank)):
        return None
    if any((take[d].start, take[d].stop) != (0, extent[d]) for take, _ in targets for d in range(split)):
        return None  # split along several dimensions (a 2-D mesh): through a buffer
    # Padding must be the file's tail: the part is the chunk's but for one dimension,
    # with only ones before it (eqxckpt's C-ordered chunks).
    short = [d for d in range(rank) if extent[d] != layout.chunk[d]]
    if short and (len(short) > 1 or any(extent[d] != 1 for d in range(short[0]))):
        return None
    outer = math.prod(extent[:split])
    if outer * len(targets) > 1 << 16:  # each run costs a view, an iovec and a CRC call
        return None
    ordered = sorted(targets, key=lambda target: target[0][split].start)
    if any(not into.flags.c_contiguous for _, into in ordered):
        return None
    itemsize = layout.dtype.itemsize
    row = math.prod(extent[split + 1 :]) * itemsize  # bytes of one index along the split dimension
    runs = [into.reshape(outer, -1).view(np.uint8) for _, into in ordered]  # run i: at outer index i
    gaps, at = [], 0  # bytes before each run (and after the last) that no block here takes
    for take, _ in ordered:
        if take[split].start < at:
            return None  # overlapping takes
        gaps.append((take[split].start - at) * row)
        at = take[split].stop
    gaps.append((extent[split] - at) * row)
    # Each gap gets bytes of its own (another process's part): the checksum covers them all.
    scratch = np.empty(sum(gaps) * outer, np.uint8)
    pieces: list[np.ndarray] = []
    used = 0
    for i in range(outer):
        for gap, run in zip(gaps, [*runs, None]):
            if gap:
                pieces.append(scratch[used : used + gap])
                used += gap
            if run is not None:
                pieces.append(run[i])
    padding = layout.chunk_nbytes - math.prod(extent) * itemsize
    if padding:
        pieces.append(np.empty(padding, np.uint8))
    return [piece for piece in pieces if piece.size]


def _check(key: str, computed: int, stored: np.ndarray) -> None:
    """Raise unless ``stored`` is ``computed``, the CRC-32C of the file's bytes."""
    if computed != int.from_bytes(stored.tobytes(), "little"):
        raise ChunkFileError(
            f"chunk {key} fails its CRC-32C checksum (stored {int.from_bytes(stored.tobytes(), 'little'):08x}, "
            f"computed {computed:08x}): its bytes changed after they were written"
        )
