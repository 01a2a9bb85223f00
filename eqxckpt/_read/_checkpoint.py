"""`open` and `Checkpoint`: a read-only, lazy view of a committed eqxckpt checkpoint."""

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._chunks import ChunkLayout, Region
from .._errors import ArgumentError
from .._leaf import StoredLeaf, check_bool_bytes
from .._storage import CheckpointPath, Storage
from .._stored import StoredArrays
from ._place import Reader, inside
from ._read_once import readers_apart
from ._select import Selection
from ._source import Source, reading


class Checkpoint(Source):
    """A committed checkpoint: its leaves, their shapes and dtypes, and metadata.

    Nothing is read from the arrays until you ask for values.

    **Attributes:** as a `Source`'s; `location` is the path or URL it was opened at,
    and `stored` owns its stored arrays (its storage backend is ``stored.storage``).

    ```python
    ckpt = eqxckpt.open("checkpoints/step_100")
    ckpt.paths                      # ['model/layers/0/weight', ...]
    ckpt.metadata["step"]           # 100
    w = ckpt["model/layers/0/weight"]  # LazyArray: shape and dtype, no data yet
    w.get()                         # numpy array
    ```
    """

    def __init__(self, stored: StoredArrays, per_process: bool = False):
        self.per_process = per_process
        self.location = stored.location
        self.stored = stored
        self.metadata = stored.manifest.metadata
        self._leaves = stored.records

    def consistent(self) -> contextlib.AbstractContextManager[None]:
        return self.stored.consistent()

    def held(self) -> contextlib.AbstractContextManager[None]:
        return self.stored.held()

    def check_unchanged(self) -> None:
        self.stored.check_unchanged()

    def _fetch(
        self, leaves: Sequence[StoredLeaf], done: Callable[[int, np.ndarray], None], reserve: Callable[[int], None]
    ) -> None:
        self.stored.fetch(leaves, done, reserve)

    def _reads_boxes(self, leaf: StoredLeaf) -> bool:
        """Any leaf with its own array (a packed one is small: read whole)."""
        return leaf.offset is None

    def _box_reader(self, leaf: StoredLeaf) -> tuple[Reader, int]:
        """Every chunk the boxes of one band need, read once (`StoredArrays.read_boxes`);
        bands of whole chunks' rows, so each chunk is read once in all."""
        layout = self.stored.layout(leaf)

        def read(pairs: Sequence[tuple[Sequence[range], np.ndarray]], window: int) -> None:
            self.stored.read_boxes(leaf, layout, pairs, window)

        return read, (layout.chunk[0] if layout.chunk else 1)

    def reads_apart(self, leaf: StoredLeaf, sharding: Any) -> bool:
        """A leaf with its own array placed block by block (`Placement`), each of whose chunks
        lies within the blocks of one process (`_read_once.readers_apart`)."""
        if leaf.offset is not None or len(sharding.device_set) == 1 or not leaf.can_shard(sharding):
            return False
        with reading(leaf):
            chunk = self.stored.layout(leaf).chunk
        return readers_apart(chunk, sharding, leaf.shape)

    def identity(self) -> str | None:
        """The save that wrote this checkpoint (its manifest's ``save_id``)."""
        return self.stored.manifest.save_id

    def read_selection(self, leaf: StoredLeaf, selection: Selection) -> np.ndarray:
        """Only the chunks holding the selection are read, each checked as a whole read
        checks it; the whole leaf chunk by chunk (a packed one from the chunks holding it)."""
        _refuse_unheld(leaf, selection.box())
        with reading(leaf):
            if leaf.offset is None and not selection.covers(leaf.data_shape):
                return self.stored.read_selection(leaf, selection)
            data = self.stored.read_whole(leaf)
            check_bool_bytes(data, leaf.path)  # all of it: a selection could skip a damaged byte
        return selection.take(data)

    def prepare_reads(self, leaves: Sequence[StoredLeaf]) -> None:
        """Their chunk layouts read and checked at once (`StoredArrays.prepare_layouts`)."""
        self.stored.prepare_layouts(leaves)

    def rows_per_read(self, leaf: StoredLeaf) -> int:
        """A chunk's rows (a packed leaf is read whole)."""
        if leaf.offset is not None or not leaf.shape:
            return super().rows_per_read(leaf)
        with reading(leaf):
            return max(1, self.stored.layout(leaf).chunk[0])

    def _read_into(self, leaf: StoredLeaf, region: Region, out: np.ndarray) -> None:
        """The chunks holding ``region``, each read once (checksum checked) straight into ``out``."""
        if leaf.offset is not None:  # packed: small, read whole
            return super()._read_into(leaf, region, out)
        _refuse_unheld(leaf, [range(s.start, s.stop) for s in region])
        with reading(leaf):
            self.stored.read_box(leaf, tuple(range(s.start, s.stop) for s in region), out)
            check_bool_bytes(out, leaf.path)

    def part_reader(self, leaf: StoredLeaf, selection: Selection) -> Callable[[Region], np.ndarray]:
        """Each part read from only the chunks it needs; a packed leaf (small) read whole."""
        if leaf.offset is not None:
            return super().part_reader(leaf, selection)
        _refuse_unheld(leaf, selection.box())
        return SelectionStream(self.stored, leaf, selection).read


def _refuse_unheld(leaf: StoredLeaf, box: Sequence[range]) -> None:
    """Raise `ArgumentError` if ``box`` of a part's leaf is not within one block the part
    holds (where the part has no chunks: never read as zeros or as a crafted file's)."""
    if leaf.blocks is not None:
        extent = tuple((r.start, r.stop) if len(r) else (0, 0) for r in box)
        if not any(inside(extent, block) for block in leaf.blocks):
            raise ArgumentError(f"Leaf {leaf.path!r}: {leaf.unheld(None)}; select within one of those blocks.")


class SelectionStream:
    """A lazy selection of a leaf with its own array, to copy from a part at a time:
    ``read(part)`` (slices from 0) reads only the chunks that part needs."""

    def __init__(self, stored: StoredArrays, leaf: StoredLeaf, selection: Selection):
        self.stored, self.leaf, self.selection = stored, leaf, selection

    @functools.cached_property
    def layout(self) -> ChunkLayout:  # checked once, not once per part
        return self.stored.layout(self.leaf)

    def read(self, part: Region) -> np.ndarray:
        with reading(self.leaf):
            layout = self.layout
        return self.stored.read_selection(self.leaf, self.selection.sub(part), layout)


def open_checkpoint(path: CheckpointPath | Storage, per_process: bool = False) -> Checkpoint:
    """An eqxckpt checkpoint, opened read-only without reading any array (`eqxckpt.open` for
    this format); ``per_process``: one process's own (`Source.per_process`)."""
    return Checkpoint(StoredArrays.open(path), per_process)
