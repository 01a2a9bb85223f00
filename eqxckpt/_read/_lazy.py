"""`LazyArray`: one stored array of any `Source`, indexed and cast lazily, read through
its source's public reads (`read_selection`, or the leaf whole)."""

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from .._chunks import Region
from .._leaf import StoredLeaf
from ._select import Selection
from ._source import Source


class LazyArray:
    """One stored array of a source, whatever its format: ``shape``, ``dtype`` and
    ``nbytes`` now, data on ``get()``.

    Indexing (``lazy[0, :4]``) and ``astype`` are deferred too. An eqxckpt
    checkpoint reads only the chunks holding the selected elements, a
    safetensors file only the bytes from the first selected row to the last;
    other formats read the tensor and select from it.

    **Attributes:** `source`, the `Source` it belongs to; `leaf`, the `StoredLeaf`
    it reads.

    ```python
    w = eqxckpt.open("ckpt")["model/w"]
    w.shape, w.dtype          # no I/O beyond the manifest
    w[:2].astype("float32").get()
    eqxckpt.open("model.safetensors")["encoder/proj/weight"][1:3].get()
    ```
    """

    def __init__(self, source: Source, leaf: StoredLeaf, index: Any = (), dtype: Any = None):
        self.source = source
        self.leaf = leaf
        self._index = index
        self._indexed = not (isinstance(index, tuple) and not index)  # compared without ==: numpy ints
        self._dtype = None if dtype is None else np.dtype(dtype)

    @property
    def leaf_path(self) -> str:
        """The leaf's path in its source.

        **Returns:** the path (``model/w``).

        ```python
        ckpt["model/w"].leaf_path  # 'model/w'
        ```
        """
        return self.leaf.path

    @property
    def checkpoint(self) -> Source:
        """The checkpoint this array belongs to (its `source`).

        **Returns:** the `Checkpoint` or other `Source` it was read from.

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
    def ndim(self) -> int:
        """The number of dimensions.

        **Returns:** ``len(shape)``.

        ```python
        ckpt["model/w"].ndim  # 2
        ```
        """
        return len(self.shape)

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

    @property
    def as_stored(self) -> bool:
        """Whether `get` gives the leaf as it is stored: neither indexed nor cast. (Saving
        such an array keeps its stored digest.)

        **Returns:** a bool.

        ```python
        ckpt["model/w"].as_stored, ckpt["model/w"][:2].as_stored  # (True, False)
        ```
        """
        return not self._indexed and self._dtype is None

    def __getitem__(self, index: Any) -> "LazyArray":
        """A lazy selection: only the selected elements are read on `get` (as far as
        the format allows: see above).

        **Arguments:**

        - `index`: a basic numpy index (ints, slices, ``...``, ``None``), applied once.

        **Returns:** a `LazyArray`. An index out of range raises numpy's `IndexError`
        now; arrays and masks raise `NotImplementedError` (index what `get` returns).

        ```python
        first_rows = ckpt["model/w"][:2].get()
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

    def _selection(self) -> Selection:
        # Of the stored shape: a PRNG key array (never indexed) is read as its key data.
        return Selection.of(self._index, self.leaf.data_shape)

    def get(self) -> Any:
        """Read the data.

        **Returns:** a numpy array (a jax key array for PRNG keys).

        ```python
        w = eqxckpt.open("ckpt")["model/w"].get()
        ```
        """
        with self.source.consistent():
            data = self.source.read_selection(self.leaf, self._selection())
        return self.leaf.host_value(data, self._dtype)

    async def get_async(self) -> Any:
        """Read without blocking the event loop.

        **Returns:** as for `get`.

        ```python
        w = await ckpt["model/w"].get_async()
        ```
        """
        return await asyncio.to_thread(self.get)

    def part_reader(self) -> Callable[[Region], np.ndarray]:
        """What copies this array (indexed and cast as it is) a part at a time, as a save
        does, without holding all of it where the format allows (`Source.part_reader`).

        **Returns:** a function of a part of `shape` (a tuple of slices from 0, step 1)
        giving that part's values (for PRNG keys: their key data), from any thread.

        ```python
        read = ckpt["model/w"].astype("float16").part_reader()
        read((slice(0, 2), slice(0, 3))).shape  # (2, 3)
        ```
        """
        read = self.source.part_reader(self.leaf, self._selection())
        dtype = self._dtype
        if dtype is None:
            return read
        return lambda part: read(part).astype(dtype)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        data = np.asarray(self.get())
        return data if dtype is None else data.astype(dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.leaf_path!r}, shape={self.shape}, dtype={self.dtype})"
