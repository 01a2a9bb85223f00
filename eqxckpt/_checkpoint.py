"""`open` and `Checkpoint`: a read-only, lazy view of a committed eqxckpt checkpoint."""

import asyncio
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._budget import read_window
from ._chunks import ChunkLayout, Region
from ._leaf import KeyRecord, StoredLeaf, check_bool_bytes
from ._manifest import Manifest
from ._progress import advance
from ._select import Selection
from ._source import LazyEntry, Source, reading
from ._storage import CheckpointPath, Pin, Storage, resolve
from ._stored import StoredArrays, slice_key


class Checkpoint(Source):
    """A committed checkpoint: its leaves, their shapes and dtypes, and metadata.

    Nothing is read from the arrays until you ask for values.

    ```python
    ckpt = eqxckpt.open("checkpoints/step_100")
    ckpt.paths                      # ['model/layers/0/weight', ...]
    ckpt.metadata["step"]           # 100
    w = ckpt["model/layers/0/weight"]  # LazyArray: shape and dtype, no data yet
    w.get()                         # numpy array
    ```
    """

    def __init__(self, location: Storage, manifest: Manifest, pin: Pin | None = None):
        self.location = location
        self.stored = StoredArrays(location, manifest)
        self.metadata = manifest.metadata
        self._leaves = self.stored.records
        self._pin = pin
        if pin is not None:
            weakref.finalize(self, pin.close)

    def _lazy(self, leaf: StoredLeaf) -> "LazyArray":
        return LazyArray(self, leaf)

    def _fetch(
        self, leaves: Sequence[StoredLeaf], done: Callable[[int, np.ndarray], None], reserve: Callable[[int], None]
    ) -> None:
        self.stored.fetch(leaves, done, reserve)

    def _read(self, wanted: Sequence[tuple[StoredLeaf, Any]]) -> list[Any]:
        """Read every selected leaf (see `Source._read` and `_fetch`). A target whose sharding
        spans several devices is read block by block instead (`BlockReads`)."""
        sharded = {i for i, (leaf, target) in enumerate(wanted) if leaf.offset is None and _sharded(leaf, target)}
        whole = [i for i in range(len(wanted)) if i not in sharded]
        values: list[Any] = [None] * len(wanted)
        for i, value in zip(whole, super()._read([wanted[i] for i in whole])):
            values[i] = value
        # Sharded targets last, a leaf at a time, each block placed on its devices before it
        # is let go: the host holds the reads' window and the blocks being filled.
        window = read_window(sum(leaf.nbytes for leaf, _ in wanted))
        for i in sorted(sharded):
            leaf, target = wanted[i]
            # Planned outside `reading`: a sharding that does not fit the shape is the
            # caller's mistake (JAX's own error), not a damaged checkpoint.
            blocks = self.stored.block_reads(leaf, target, window)
            with reading(leaf):
                values[i] = leaf.assemble(target, blocks, lambda index, shape=leaf.shape: slice_key(index, shape))
            advance(leaf.nbytes)
        return values


def _sharded(leaf: StoredLeaf, target: Any) -> bool:
    """Whether to read ``target`` block by block: each device's block, on its process."""
    sharding = getattr(target, "sharding", None)
    if sharding is None or (len(sharding.device_set) == 1 and sharding.is_fully_addressable):
        return False
    return leaf.can_shard(sharding)


class LazyArray(LazyEntry):
    """One stored array: ``shape``, ``dtype`` and ``nbytes`` now, data on ``get()``.

    Indexing (``lazy[0, :4]``) and ``astype`` are deferred too, so only the
    selected elements are ever read.

    ```python
    w = eqxckpt.open("ckpt")["model/w"]
    w.shape, w.dtype          # no I/O beyond the manifest
    w[:2].astype("float32").get()
    ```
    """

    source: Checkpoint

    def __init__(self, checkpoint: Checkpoint, leaf: StoredLeaf, index: Any = (), dtype: Any = None):
        super().__init__(checkpoint, leaf)
        self._index = index
        self._indexed = not (isinstance(index, tuple) and not index)  # compared without ==: numpy ints
        self._dtype = None if dtype is None else np.dtype(dtype)

    @property
    def checkpoint(self) -> Checkpoint:
        """The checkpoint this array belongs to.

        **Returns:** the `Checkpoint` it was read from.

        ```python
        lazy.checkpoint.metadata
        ```
        """
        return self.source

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of what `get` returns (after any indexing).

        **Returns:** a tuple of ints.

        ```python
        ckpt["model/w"][:2].shape  # (2, 3)
        ```
        """
        shape = self.leaf.shape
        if not self._indexed:
            return shape
        return Selection.of(self._index, shape).shape

    @property
    def dtype(self) -> np.dtype:
        """The dtype of what `get` returns (after any `astype`; ``key<impl>`` for PRNG keys).

        **Returns:** a numpy dtype.

        ```python
        ckpt["model/w"].astype("float16").dtype  # dtype('float16')
        ```
        """
        return self._dtype if self._dtype is not None else self.leaf.value_dtype

    @property
    def nbytes(self) -> int:
        """Bytes `get` returns (for PRNG keys: their key data).

        **Returns:** an int.

        ```python
        sum(ckpt[p].nbytes for p in ckpt.paths if p.startswith("model/"))
        ```
        """
        return self.leaf.selection_nbytes(self.shape, self.dtype)

    def __getitem__(self, index: Any) -> "LazyArray":
        """A lazy selection: only the selected elements are read on `get`.

        **Arguments:**

        - `index`: a basic numpy index (ints, slices, ``...``, ``None``), applied once.

        **Returns:** a `LazyArray`. An index out of range raises numpy's `IndexError`
        now; arrays and masks raise `NotImplementedError` (index what `get` returns).

        ```python
        first_rows = ckpt["model/embedding"][:16].get()
        ```
        """
        if self._indexed:
            raise NotImplementedError("Index a LazyArray once; combine the indices into one expression.")
        if not self.leaf.sliceable:
            raise NotImplementedError(
                f"Leaf {self.leaf_path!r} ({self.leaf.describe()}) cannot be sliced lazily; get() the whole array."
            )
        Selection.of(index, self.leaf.shape)  # refused now, not when read
        return LazyArray(self.source, self.leaf, index, self._dtype)

    def astype(self, dtype: Any) -> "LazyArray":
        """A lazy cast: the conversion happens on ``get()``.

        **Arguments:**

        - `dtype`: the dtype to convert to (numpy's conversion rules).

        **Returns:** a `LazyArray`.

        ```python
        w = ckpt["model/w"].astype("float32").get()
        ```
        """
        return LazyArray(self.source, self.leaf, self._index, dtype)

    def _stream(self) -> "SelectionStream | np.ndarray":
        """What to copy this array (indexed and cast as it is) from a part at a time,
        without reading it all into memory; a packed leaf (small) is read whole."""
        if self.leaf.offset is not None:
            with reading(self.leaf):
                data = self._data()
            return data if self._dtype is None else data.astype(self._dtype)
        # The stored shape: a PRNG key array (never indexed) is copied as its key data.
        return SelectionStream(self.source, self.leaf, Selection.of(self._index, self.leaf.data_shape), self._dtype)

    def _saved_as(self, path: str, keys: tuple[KeyRecord, ...]) -> StoredLeaf:
        """The leaf this array becomes when it is saved at ``path`` (copied from its checkpoint)."""
        changed = self._indexed or self._dtype is not None
        return self.leaf.copied(path, keys, tuple(self.shape), self.dtype, changed=changed)

    def _data(self) -> np.ndarray:
        """The selected stored values: the whole leaf read chunk by chunk (a packed one from
        the chunks holding it), a selection from only the chunks holding it, through the
        same reader and checks."""
        if self.leaf.offset is None and self._indexed:
            return self.source.stored.read_selection(self.leaf, Selection.of(self._index, self.leaf.shape))
        data = self.source.stored.read_whole(self.leaf)
        check_bool_bytes(data, self.leaf.path)  # all of it: a selection could skip a damaged byte
        return data[self._index] if self._indexed else data

    def get(self) -> Any:
        """Read the data.

        **Returns:** a numpy array (a jax key array for PRNG keys).

        ```python
        w = eqxckpt.open("ckpt")["model/w"].get()
        ```
        """
        with self.source.consistent(), reading(self.leaf):
            data = self._data()
        return self.leaf.host_value(data, self._dtype)

    async def get_async(self) -> Any:
        """Read without blocking the event loop.

        **Returns:** as for `get`.

        ```python
        w = await ckpt["model/w"].get_async()
        ```
        """
        return await asyncio.to_thread(self.get)


class SelectionStream:
    """A lazy selection of a leaf with its own array, to copy from a part at a time:
    ``stream[part]`` (slices from 0) reads only the chunks that part needs."""

    def __init__(self, checkpoint: Checkpoint, leaf: StoredLeaf, selection: Selection, dtype: np.dtype | None):
        self._checkpoint, self._leaf, self._selection, self._dtype = checkpoint, leaf, selection, dtype

    @functools.cached_property
    def _layout(self) -> ChunkLayout:  # checked once, not once per part
        return self._checkpoint.stored.layout(self._leaf)

    def __getitem__(self, part: Region) -> np.ndarray:
        with reading(self._leaf):
            layout = self._layout
        data = self._checkpoint.stored.read_selection(self._leaf, self._selection.sub(part), layout)
        return data if self._dtype is None else data.astype(self._dtype)


def open_checkpoint(path: CheckpointPath | Storage) -> Checkpoint:
    """An eqxckpt checkpoint, opened read-only without reading any array (`eqxckpt.open` for this format)."""
    location = resolve(path)
    manifest, pin = location.read_manifest()
    return Checkpoint(location, manifest, pin)
