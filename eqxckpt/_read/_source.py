"""`Source`, the read-only interface every readable checkpoint implements (`LazyArray`,
one stored array of any source, is in `_lazy`; the restore engine that reads a source's
leaves into their targets, in `_restore`).

A source is a set of named leaves (`Leaf`: path, key records, shape and dtype
for arrays) with metadata, and a small I/O core that reads the stored ones: a
format implements `_fetch` (leaves whole) and, to read less than a whole leaf,
`chunk_shapes` and `_read_boxes`. Everything else (restores, lazy selections,
regions, parts for a save, reads across processes) is built on those, once.
eqxckpt checkpoints (`Checkpoint`), safetensors, Orbax and TensorFlow checkpoints
and translated views of any of them (`CheckpointTranslator.apply`) are sources, so
`load`, `Transform` and `CheckpointTranslator` work on all of them alike.
"""

import abc
import contextlib
import math
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .._chunks import Region
from .._errors import ArgumentError
from .._formats._convert import aligned_empty
from .._leaf import Leaf, StoredLeaf, check_bool_bytes, refuse_narrowing
from .._paths import depth, did_you_mean, normalize_at, relative_to
from .._storage import UNPINNED, Pin, reading
from .._tree import build_plain_tree
from .._window import check_allocation, read_window
from ._place import inside
from ._select import Selection

# Boxes of one leaf to fill: each a range of indices per dimension (ascending, step 1 in
# a restore's and a region's, any positive step in a lazy selection's) and a C-contiguous
# buffer shaped like it, in the leaf's stored dtype.
Boxes = Sequence[tuple[Sequence[range], np.ndarray]]


class Source(abc.ABC):
    """What `eqxckpt.open` returns for every format: a read-only, lazily read set of
    named leaves and their metadata, which `eqxckpt.load` restores.

    `Checkpoint` is the one for eqxckpt's own format; safetensors files, Orbax and
    TensorFlow checkpoints and `CheckpointTranslator` views are the others. Index
    it by leaf path for lazy leaves (`LazyArray`); `paths`, `metadata`, `records()`,
    `tree()`; each leaf's description is a `Leaf`.

    **Attributes:** `location`, where it was opened (the path or URL, as a user writes
    it: ``gs://bucket/run/step_100/``); `metadata`, its metadata.

    ```python
    source = eqxckpt.open("model.safetensors")
    assert isinstance(source, eqxckpt.Source)
    print(source.paths[:3], source.metadata)
    ```

    **A new format** is one subclass: the docs' "Writing a source format" page has its
    contract, with a toy format, and the methods the engine reads with.
    """

    location: str  # the path or URL it was opened at, as a user writes it
    metadata: dict[str, Any]
    _leaves: Mapping[str, Leaf]
    # Whether the format holds arrays only (safetensors, TensorFlow): then `load` takes a
    # `like`'s other leaves (Dropout's `p` and `inference`) from `like`, as `transforms=` does.
    arrays_only: bool = False
    # One process's own checkpoint (a local tier's part): each process of a job restores
    # from its own, so a restore never reads it together with the others (`read_once`).
    per_process: bool = False

    _pin: Pin = UNPINNED  # what proves the source read is the one opened

    # -- what a format implements ---------------------------------------------------

    def _fetch(
        self, leaves: Sequence[StoredLeaf], done: Callable[[int, np.ndarray], None], reserve: Callable[[int], None]
    ) -> None:
        """Read each of ``leaves`` whole, as stored (its dtype, its ``data_shape``), and call
        ``done(i, data)`` for each, in any order; call ``reserve(nbytes)`` with the bytes it
        will hold before it allocates them (once the files were checked to hold them).
        Failures may be raised as they are: the engine names the leaf."""
        raise NotImplementedError(f"{type(self).__name__} reads no stored arrays.")

    def chunk_shapes(self, leaves: Sequence[StoredLeaf]) -> list[tuple[int, ...] | None]:
        """The smallest box a read of each leaf takes, however little of it is wanted: a
        chunk's shape (eqxckpt's arrays), a row's (safetensors); None where the format
        reads a leaf only whole (`_fetch`). What the engine plans reads of parts with:
        windows of rows, bands of a sharded restore, which process reads what.

        This format reads every leaf whole.

        **Arguments:**

        - `leaves`: `StoredLeaf`s of this source.

        **Returns:** one shape (as many dimensions as the leaf's stored ones) or None per leaf.

        ```python
        ckpt.chunk_shapes([ckpt.leaf("model/w")])  # [(4, 3)]: its one chunk
        ```
        """
        return [None for _ in leaves]

    def _read_boxes(self, leaf: StoredLeaf, boxes: Boxes, window: int) -> None:
        """Fill each buffer of ``boxes`` (none empty) with its box of ``leaf``'s stored
        values (checked as a whole read checks them), within ``window`` bytes of reads in
        flight, from any thread. Called only for leaves with a `chunk_shapes` entry; this
        reads the leaf whole (`_fetch`) and copies each box out."""
        data = self._whole(leaf)
        for box, out in boxes:
            out[...] = data[tuple(slice(r.start, r.stop, r.step) for r in box)]

    def identity(self) -> str | None:
        """What tells this very checkpoint from any other, even one written later at the
        same place: several processes restoring together check that they opened the same
        one before any of them moves data to another. None where the format records none
        (a safetensors file, say: such sources never read apart, see `reads_apart`).

        **Returns:** a string, or None.

        ```python
        len(ckpt.identity())  # 32: an eqxckpt checkpoint's save, a hex UUID
        ```
        """
        return None

    # -- reads, the same for every format -------------------------------------------

    def read(self, wanted: Sequence[tuple[StoredLeaf, Any]]) -> list[Any]:
        """Read stored leaves whole, each into what its target asks for (None: as saved).

        The one read contract of a restore: this checks the memory it needs before it is
        allocated, names the leaf in any failure, finishes each array into its target
        (checked casts included) and reports progress (the engine, `_restore`, over the
        format's `_fetch` and `_read_boxes`).

        **Arguments:**

        - `wanted`: ``(leaf, target)`` pairs: a `StoredLeaf` of this source, and a leaf
          of `like` (an array or a `jax.ShapeDtypeStruct`, whose sharding is honoured)
          or None.

        **Returns:** the values, in the order of ``wanted``. A leaf JAX would change (64-bit
        data read into JAX with ``jax_enable_x64`` off) raises `CastError` before any read.

        Inside `consistent`, what is read is one checkpoint's.

        ```python
        with ckpt.consistent():
            w, b = ckpt.read([(ckpt.leaf("model/w"), None), (ckpt.leaf("model/b"), jnp.zeros(3))])
        ```
        """
        from ._restore import read_stored

        if unstored := [leaf.path for leaf, _ in wanted if not isinstance(leaf, StoredLeaf)]:
            raise ArgumentError(
                f"Source.read reads stored arrays; {unstored[:5]} of {self.location} hold none (scalars, None, "
                "code): take their values from `load` or from `leaf(path).value()`."
            )
        refuse_narrowing(wanted, f"Cannot read from {self.location} without changing values")
        return read_stored(self, wanted)

    def read_into(self, leaf: StoredLeaf, region: Region, out: np.ndarray) -> None:
        """Fill ``out`` with the stored values of a box of one leaf, checked as a restore
        checks them: what a `Stack` or `Unstack` restore reads each layer, or window of
        rows, with. A format that reads parts (`chunk_shapes`) reads only what the box
        needs, straight into ``out``.

        **Arguments:**

        - `leaf`: a `StoredLeaf` of this source (an array: not a PRNG key).
        - `region`: one slice (step 1, within the shape) per dimension of the leaf.
        - `out`: a C-contiguous array of the region's shape and the leaf's stored dtype.

        **Returns:** nothing; ``out`` holds the values. Thread-safe. A region outside the
        leaf (or with a step), or an ``out`` of another shape or dtype, is an `ArgumentError`.

        ```python
        out = np.empty((2, 3), np.float32)
        ckpt.read_into(ckpt.leaf("model/w"), (slice(1, 3), slice(0, 3)), out)
        out[:, 0]  # np.array([3.0, 6.0])
        ```
        """
        box = tuple(range(s.start, s.stop) for s in checked_region(leaf, region, out))
        refuse_unheld(leaf, box)
        if not out.size:
            return
        if self.chunk_shapes([leaf])[0] is None:  # read only whole
            out[...] = self._whole(leaf)[tuple(slice(r.start, r.stop) for r in box)]
        else:
            with reading(leaf):
                self._read_boxes(leaf, [(box, out)], read_window(out.nbytes))
                if out.shape == leaf.data_shape:  # all of it: checked as a whole read is
                    leaf.check_whole(out)
        check_bool_bytes(out, leaf.path)

    def read_selection(self, leaf: StoredLeaf, selection: Selection) -> np.ndarray:
        """The stored values that ``selection`` takes of one leaf, as stored (its dtype; for
        PRNG keys, key data), checked as a restore checks them. What `LazyArray.get` reads:
        only the chunks (or rows) holding the selection, where the format reads parts.

        **Arguments:**

        - `leaf`: a `StoredLeaf` of this source.
        - `selection`: a basic index of its stored shape, normalised (what indexing a
          `LazyArray` makes).

        **Returns:** a numpy array of the selection's shape.

        ```python
        ckpt["model/w"][1:3, 0].get()  # np.array([3.0, 6.0])
        ```
        """
        box = selection.box()
        refuse_unheld(leaf, box)
        # Every element (in any order): read whole, so its digest is checked.
        every = len(box) == len(leaf.data_shape) and all(len(r) == n for r, n in zip(box, leaf.data_shape))
        if every or self.chunk_shapes([leaf])[0] is None:
            data = self._whole(leaf)
            check_bool_bytes(data, leaf.path)  # all of it: a selection could skip a damaged byte
            return selection.take(data)
        shape, dtype = tuple(len(r) for r in box), np.dtype(leaf.dtype)
        check_allocation(math.prod(shape) * dtype.itemsize, f"Reading leaf {leaf.path!r} of {self.location}")
        out = aligned_empty(shape, dtype)
        if out.size:
            with reading(leaf):
                self._read_boxes(leaf, [(box, out)], read_window(out.nbytes))
            check_bool_bytes(out, leaf.path)
        return selection.finish(out)

    def part_reader(self, leaf: StoredLeaf, selection: Selection) -> Callable[[Region], np.ndarray]:
        """What a save copies a selection of one leaf from, a part at a time: a function of
        a part of the selection (a tuple of slices from 0) giving its stored values. Where
        the format reads parts, each part reads only what it needs; else the selection is
        read once and handed out in parts.

        **Arguments:**

        - `leaf`, `selection`: as for `read_selection`.

        **Returns:** the function, which may be called from several threads at once.

        ```python
        ckpt["model/w"].part_reader()((slice(0, 1), slice(0, 3)))  # np.array([[0.0, 1.0, 2.0]])
        ```
        """
        if self.chunk_shapes([leaf])[0] is None:
            data = self.read_selection(leaf, selection)
            return lambda part: data[part]
        refuse_unheld(leaf, selection.box())
        return lambda part: self.read_selection(leaf, selection.sub(part))

    def rows_per_read(self, leaf: StoredLeaf) -> int:
        """How many leading rows of ``leaf`` a read takes at the least, however few are
        wanted (its `chunk_shapes` entry's first dimension; all its rows where it is read
        only whole). An `Unstack` restore reads a stacked leaf's rows in windows of
        multiples of it, so each row is read once.

        **Arguments:**

        - `leaf`: a `StoredLeaf` of this source.

        **Returns:** a positive int.

        ```python
        ckpt.rows_per_read(ckpt.leaf("model/w"))  # 4: its chunk holds every row
        ```
        """
        unit = self.chunk_shapes([leaf])[0]
        if unit is None:
            return max(1, leaf.data_shape[0]) if leaf.data_shape else 1
        return max(1, unit[0]) if unit else 1

    def reads_apart(self, leaf: StoredLeaf, sharding: Any) -> bool:
        """Whether a restore of ``leaf`` into a target laid out by ``sharding`` reads, in
        each process, only what that process's devices hold, and no stored piece (chunk)
        in two processes that hold different parts: where it does, a restore across several
        processes reads a target replicated over processes once in all (see the scale
        guide). Only a format with an `identity` does (the processes must agree on what
        they read), for a leaf it reads in parts.

        **Arguments:**

        - `leaf`: a `StoredLeaf` of this source.
        - `sharding`: a `jax.sharding.Sharding` over several devices.

        **Returns:** a bool.

        ```python
        mesh = jax.sharding.Mesh(jax.devices(), ("x",))
        ckpt.reads_apart(ckpt.leaf("model/w"), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        ```
        """
        from ._read_once import readers_apart

        if self.identity() is None or len(sharding.device_set) == 1 or not leaf.can_shard(sharding):
            return False
        with reading(leaf):
            unit = self.chunk_shapes([leaf])[0]
        return unit is not None and readers_apart(unit, sharding, leaf.data_shape)

    def _whole(self, leaf: StoredLeaf) -> np.ndarray:
        """One leaf's stored array, read whole (`_fetch`), checked against its digest as a
        restore checks it (a part's leaf, holding some blocks, by its blocks' reads)."""
        found: list[np.ndarray] = []
        reserve = lambda nbytes: check_allocation(nbytes, f"Reading leaf {leaf.path!r} of {self.location}")  # noqa: E731
        with reading(leaf):
            self._fetch([leaf], lambda _, data: found.append(data), reserve)
            leaf.check_whole(found[0])
        return found[0]

    def consistent(self) -> contextlib.AbstractContextManager[None]:
        """Reads inside come from this checkpoint alone, or raise `CheckpointChangedError`.

        On a local disk, a shared lock keeps eqxckpt's retention from deleting it
        meanwhile; afterwards (or when a read fails) the checkpoint must still be
        the one whose metadata was read: not replaced, not being deleted. Sources
        without a pin (a single open file, TensorFlow's reader) read as they are.

        **Returns:** a context manager.

        ```python
        ckpt = eqxckpt.open("ckpt")
        with ckpt.consistent():  # both from the same checkpoint, or an error
            w, b = ckpt["model/w"].get(), ckpt["model/b"].get()
        ```
        """
        return self._pin.consistent(self.location)

    def held(self) -> contextlib.AbstractContextManager[None]:
        """On a local disk, a shared lock that keeps eqxckpt's retention from deleting this
        checkpoint while the block runs. Unlike `consistent`, nothing is checked afterwards.

        **Returns:** a context manager; entering it raises `CheckpointChangedError` if the
        checkpoint is gone already.

        ```python
        with ckpt.held():  # a save taking files from ckpt holds it so
            ...
        ```
        """
        return self._pin.held(self.location)

    def check_unchanged(self) -> None:
        """Raise `CheckpointChangedError` if the checkpoint was replaced or deleted since it was opened.

        **Returns:** nothing; sources without a pin (a single open file) never raise.

        ```python
        ckpt.check_unchanged()  # what was read so far is this checkpoint's
        ```
        """
        self._pin.check_unchanged(self.location)

    # -- description ---------------------------------------------------------------

    @property
    def paths(self) -> list[str]:
        """Every leaf path, in the order they were saved.

        **Returns:** a list of paths (``model/layers/0/weight``).

        ```python
        [p for p in ckpt.paths if p.startswith("opt_state/")]
        ```
        """
        return list(self._leaves)

    @property
    def nbytes(self) -> int:
        """Total bytes of all stored arrays.

        **Returns:** an int.

        ```python
        print(f"{ckpt.nbytes / 2**20:.1f} MiB")
        ```
        """
        return sum(leaf.nbytes for leaf in self._leaves.values())

    def leaf(self, leaf_path: str) -> Leaf:
        """The description of one leaf; a `KeyError` suggests near names.

        **Arguments:**

        - `leaf_path`: the leaf's path (``model/w``).

        **Returns:** its `Leaf` (an `ArrayLeaf`, `KeyLeaf`, `ScalarLeaf` or `OpaqueLeaf`):
        ``kind``, ``describe()``, and for stored arrays (`StoredLeaf`) ``shape`` and ``dtype``.

        ```python
        ckpt.leaf("model/w").describe()  # 'float32[4,3]'
        ```
        """
        try:
            return self._leaves[leaf_path]
        except KeyError:
            raise KeyError(
                f"No leaf {leaf_path!r} in {self.location}.{did_you_mean(leaf_path, self._leaves)}"
            ) from None

    def origin(self, leaf_path: str) -> str:
        """The name the leaf at ``leaf_path`` has in the format that stores it, so errors
        can name foreign tensors as their users know them.

        **Arguments:**

        - `leaf_path`: the leaf's path here (``encoder/block/0/layer/0/SelfAttention/q/weight``).

        **Returns:** the stored name: the path itself for eqxckpt and TensorFlow
        checkpoints, the dotted tensor name for safetensors
        (``encoder.block.0.layer.0.SelfAttention.q.weight``), and for a
        `CheckpointTranslator` view the original's name of a leaf a rule renamed
        (followed by ``(transposed)`` where the rule transposed it).

        ```python
        eqxckpt.open("model.safetensors").origin("encoder/proj/weight")  # 'encoder.proj.weight'
        ```
        """
        self.leaf(leaf_path)
        return leaf_path

    def records(self, at: str | None = None) -> dict[str, Leaf]:
        """The leaves under ``at``.

        **Arguments:**

        - `at`: a path prefix (None: every leaf).

        **Returns:** ``{path relative to at: Leaf}``.

        ```python
        list(ckpt.records("model"))  # ['b', 'w']
        ```
        """
        prefix = normalize_at(at)
        if not prefix:
            return dict(self._leaves.items())
        out = {}
        for path in self._leaves:  # (only the leaves under at are looked up: made, where that is lazy)
            rel = relative_to(path, prefix)
            if rel is not None:
                out[rel] = self._leaves[path]
        return out

    def __contains__(self, path: object) -> bool:
        return path in self._leaves

    def __iter__(self) -> Iterator[str]:
        return iter(self._leaves)

    def __len__(self) -> int:
        return len(self._leaves)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r}, {len(self)} leaves, {self.nbytes} bytes)"

    # -- values ----------------------------------------------------------------------

    def __getitem__(self, path: str) -> Any:
        """A leaf (a lazy array, or the scalar itself) or, for a prefix, a subtree.

        **Arguments:**

        - `path`: a leaf's path, or a prefix of several.

        **Returns:** a `LazyArray`, a scalar, or nested dicts and lists of them.

        ```python
        ckpt["step"], ckpt["model/w"].shape, ckpt["model"]
        ```
        """
        if path in self._leaves:
            return self._value(self._leaves[path])
        if self.records(path):
            return self.tree(at=path)
        self.leaf(path)  # raises a KeyError with suggestions

    def tree(self, at: str | None = None) -> Any:
        """Nested dicts/lists of lazy arrays and scalars, rebuilt from the leaves' keys.

        **Arguments:**

        - `at`: a path prefix (None: everything).

        **Returns:** the subtree, nothing read yet.

        ```python
        lazy_opt_state = ckpt.tree(at="opt_state")
        ```
        """
        leaves = self.records(at).values()
        return build_plain_tree([(leaf.keys, self._value(leaf)) for leaf in leaves], depth(normalize_at(at)))

    def _value(self, leaf: Leaf) -> Any:
        """A leaf's value as far as is known without reading: lazy for stored arrays,
        the scalar for scalars, None for opaque leaves."""
        from ._lazy import LazyArray  # which reads through this interface

        return LazyArray(self, leaf) if isinstance(leaf, StoredLeaf) else leaf.value()


def refuse_unheld(leaf: StoredLeaf, box: Sequence[range]) -> None:
    """Raise `ArgumentError` if ``box`` of a part's leaf is not within one block the part
    holds (where the part has no chunks: never read as zeros or as a crafted file's)."""
    if leaf.blocks is not None:
        extent = tuple((r.start, r.stop) if len(r) else (0, 0) for r in box)
        if not any(inside(extent, block) for block in leaf.blocks):
            raise ArgumentError(f"Leaf {leaf.path!r}: {leaf.unheld(None)}; select within one of those blocks.")


def checked_region(leaf: StoredLeaf, region: Any, out: Any) -> Region:
    """``region`` as slices of ints from 0 to each dimension's length (None: the whole
    dimension), or an `ArgumentError` saying why it is not a box of ``leaf`` that ``out``
    can hold: `Source.read_into` never reads past a leaf, nor into the wrong buffer."""
    what = f"read_into of leaf {leaf.path!r} ({leaf.describe()})"
    if not leaf.sliceable:
        raise ArgumentError(f"{what}: it cannot be read in parts; read it whole (LazyArray.get).")
    if not isinstance(region, tuple) or len(region) != len(leaf.shape) or not all(isinstance(s, slice) for s in region):
        raise ArgumentError(f"{what}: the region must be a tuple of {len(leaf.shape)} slices, got {region!r}.")
    checked = []
    for s, n in zip(region, leaf.shape):
        try:
            start = 0 if s.start is None else operator.index(s.start)
            stop = n if s.stop is None else operator.index(s.stop)
        except TypeError:
            raise ArgumentError(f"{what}: {s!r} must have int bounds.") from None
        if s.step not in (None, 1) or not 0 <= start <= stop <= n:
            raise ArgumentError(f"{what}: {s!r} is not a range of a dimension of length {n} (from 0, step 1).")
        checked.append(slice(start, stop))
    shape = tuple(s.stop - s.start for s in checked)
    dtype = np.dtype(leaf.dtype)
    if not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != dtype:
        found = f"{out.dtype}{list(out.shape)}" if isinstance(out, np.ndarray) else type(out).__name__
        raise ArgumentError(f"{what}: out must be a numpy array of {dtype}{list(shape)}, got {found}.")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ArgumentError(f"{what}: out must be C-contiguous and writeable.")
    return tuple(checked)
