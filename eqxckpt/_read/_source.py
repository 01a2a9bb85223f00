"""`Source`, the read-only interface every readable checkpoint implements (`LazyArray`,
one stored array of any source, is in `_lazy`).

A source is a set of named leaves (`Leaf`: path, key records, shape and dtype
for arrays) with metadata, and a way to read the stored ones. eqxckpt
checkpoints (`Checkpoint`), TensorFlow checkpoints (`eqxckpt.t5`) and
translated views of either (`CheckpointTranslator.apply`) are sources, so
`load`, `Transform` and `CheckpointTranslator` work on all of them alike.
"""

import abc
import contextlib
import functools
import math
import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .._chunks import Region
from .._errors import ArgumentError
from .._formats._convert import Adoption, Adoptions
from .._leaf import Leaf, StoredLeaf, check_bool_bytes, refuse_narrowing
from .._paths import depth, did_you_mean, normalize_at, relative_to
from .._progress import advance
from .._storage import UNPINNED, Pin, reading
from .._tree import build_plain_tree
from .._window import check_allocation, host_memory_budget, read_window, start_jax
from ._place import PlacedDigest, Placement, Reader, on_host
from ._select import Selection


class Source(abc.ABC):
    """What `eqxckpt.open` returns for every format: a read-only, lazily read set of
    named leaves and their metadata, which `eqxckpt.load` restores.

    `Checkpoint` is the one for eqxckpt's own format; safetensors files, Orbax and
    TensorFlow checkpoints and `CheckpointTranslator` views are the others. Index
    it by leaf path for lazy leaves (`LazyArray`); `paths`, `metadata`, `records()`,
    `tree()`; each leaf's description is a `Leaf`.

    **Attributes:** `location`, where it was opened (the path or URL, as a user writes
    it: ``gs://bucket/run/step_100/``); `metadata`, its metadata.

    A format is a subclass that lists its leaves and reads their stored arrays: it
    implements `read` (or the ``_fetch`` that `read` calls), and may override
    `read_selection` and `part_reader` to read less than a whole leaf.

    ```python
    source = eqxckpt.open("model.safetensors")
    assert isinstance(source, eqxckpt.Source)
    print(source.paths[:3], source.metadata)
    ```
    """

    location: str  # the path or URL it was opened at, as a user writes it
    metadata: dict[str, Any]
    _leaves: dict[str, Leaf]
    # Whether the format holds arrays only (safetensors, TensorFlow): then `load` takes a
    # `like`'s other leaves (Dropout's `p` and `inference`) from `like`, as `transforms=` does.
    arrays_only: bool = False
    # One process's own checkpoint (a local tier's part): each process of a job restores
    # from its own, so a restore never reads it together with the others (`read_once`).
    per_process: bool = False

    _pin: Pin = UNPINNED  # what proves the source read is the one opened

    def read(self, wanted: Sequence[tuple[StoredLeaf, Any]]) -> list[Any]:
        """Read stored leaves whole, each into what its target asks for (None: as saved).

        The one read contract of a restore: this checks the memory it needs before it is
        allocated, names the leaf in any failure, finishes each array into its target
        (checked casts included) and reports progress. A format's source only fetches
        stored arrays (``_fetch``), or overrides ``_read`` to make some values otherwise;
        the checks below hold for every source.

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
        if unstored := [leaf.path for leaf, _ in wanted if not isinstance(leaf, StoredLeaf)]:
            raise ArgumentError(
                f"Source.read reads stored arrays; {unstored[:5]} of {self.location} hold none (scalars, None, "
                "code): take their values from `load` or from `leaf(path).value()`."
            )
        refuse_narrowing(wanted, f"Cannot read from {self.location} without changing values")
        return self._read(wanted)

    def _read(self, wanted: Sequence[tuple[StoredLeaf, Any]]) -> list[Any]:
        """`read` of checked pairs: this reads every format's stored arrays (through
        `_fetch`); a source whose leaves are made otherwise (`TranslatedSource`) overrides it."""
        start_jax()
        values: list[Any] = [None] * len(wanted)
        placements = {i: self._placement(leaf, target) for i, (leaf, target) in enumerate(wanted)}
        whole = [i for i, placement in placements.items() if placement is None]

        adoptions = Adoptions()  # jax arrays of leaves read whole, made together at the end

        # A leaf wanted twice may be fetched once: each value but the first gets a copy, as
        # a jax array adopts its buffer and a numpy value of the same buffer could change it.
        handed: set[tuple[int, int]] = set()
        lock = threading.Lock()

        def done(j: int, data: np.ndarray) -> None:
            leaf, target = wanted[whole[j]]
            with lock:
                again = (data.ctypes.data, data.nbytes) in handed
                handed.add((data.ctypes.data, data.nbytes))
            if again and data.nbytes:
                data = data.copy()
            with reading(leaf):
                if (digesting := leaf.digesting()) is not None:
                    leaf.check_known()  # what it is (a PRNG implementation) before what it holds
                    digesting.update(data)
                    leaf.check_digest(digesting.value)
                values[whole[j]] = leaf.finish(data, target, adoptions)
            advance(leaf.nbytes)

        def reserve(nbytes: int) -> None:
            check_allocation(nbytes, f"Restoring {len(wanted)} leaves from {self.location}")

        if whole or not wanted:
            self._fetch([wanted[i][0] for i in whole], done, reserve)
            adoptions.place()
            for i in whole:
                if isinstance(values[i], Adoption):
                    values[i] = values[i].value
        # Then the leaves placed a band at a time, each on its devices before the next is read.
        window = read_window(sum(leaf.nbytes for leaf, _ in wanted))
        for i, placement in placements.items():
            if placement is None:
                continue
            leaf, target = wanted[i]
            with reading(leaf):
                read, rows = self._box_reader(leaf)
                digest = PlacedDigest.of(leaf, placement)
                run = functools.partial(placement.run, read=read, window=window, rows=rows, seen=digest)
                values[i] = leaf.assemble(target, run)
                if digest is not None:
                    digest.check()
            advance(leaf.nbytes)
        return values

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

    def reads_apart(self, leaf: StoredLeaf, sharding: Any) -> bool:
        """Whether `read` of ``leaf`` into a target laid out by ``sharding`` reads, in each
        process, only what that process's devices hold, and no stored piece (chunk) in two
        processes that hold different parts. Where it does, a restore across several
        processes reads a target replicated over processes once in all (see the scale
        guide). This format reads every leaf whole in every process.

        **Arguments:**

        - `leaf`: a `StoredLeaf` of this source.
        - `sharding`: a `jax.sharding.Sharding` over several devices.

        **Returns:** a bool.

        ```python
        mesh = jax.sharding.Mesh(jax.devices(), ("x",))
        ckpt.reads_apart(ckpt.leaf("model/w"), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
        ```
        """
        return False

    def _placement(self, leaf: StoredLeaf, target: Any) -> Placement | None:
        """How ``leaf`` goes onto ``target``'s devices a band at a time, or None where it is read
        whole: a target sharded over several devices, or on one device a leaf larger than the
        host memory budget that would otherwise be held whole on the host (a device other than
        a CPU, or a cast). Planned before anything is read: a sharding that does not fit the
        shape is the caller's mistake (JAX's own error), not a damaged checkpoint."""
        placed = leaf.placement(target)
        if placed is None or not self._reads_boxes(leaf):
            return None
        sharding, dtype = placed
        budget = host_memory_budget()
        if len(sharding.device_set) == 1 and sharding.is_fully_addressable:
            if leaf.nbytes <= budget or (on_host(sharding.device_set) and dtype == np.dtype(leaf.dtype)):
                return None
        elif not leaf.can_shard(sharding):
            return None
        return Placement(leaf.data_shape, sharding, np.dtype(leaf.dtype), dtype, budget)

    def _reads_boxes(self, leaf: StoredLeaf) -> bool:
        """Whether this format reads a box of ``leaf`` without reading all of it (`_box_reader`)."""
        return leaf.sliceable and bool(leaf.shape) and self.rows_per_read(leaf) < leaf.shape[0]

    def _box_reader(self, leaf: StoredLeaf) -> tuple[Reader, int]:
        """What fills host buffers with boxes of ``leaf`` (`Reader`), and the rows a band of
        it should be a multiple of. This reads runs of whole rows with `_read_into`: straight
        into buffers of whole rows, else a window of rows at a time, copied out."""
        shape, dtype = leaf.data_shape, np.dtype(leaf.dtype)
        rest = tuple(slice(0, n) for n in shape[1:])
        row_bytes = math.prod(shape[1:]) * dtype.itemsize

        def read(pairs: Sequence[tuple[tuple[range, ...], np.ndarray]], window: int) -> None:
            pairs = [(box, out) for box, out in pairs if out.size]
            if all(all(len(r) == n for r, n in zip(box[1:], shape[1:])) for box, _ in pairs):
                for box, out in pairs:
                    self._read_into(leaf, (slice(box[0].start, box[0].stop), *rest), out)
                return
            start, stop = min(box[0].start for box, _ in pairs), max(box[0].stop for box, _ in pairs)
            step = max(1, window // max(1, row_bytes))
            for a in range(start, stop, step):
                b = min(stop, a + step)
                rows = np.empty((b - a, *shape[1:]), dtype)
                self._read_into(leaf, (slice(a, b), *rest), rows)
                for box, out in pairs:
                    lo, hi = max(a, box[0].start), min(b, box[0].stop)
                    if lo < hi:
                        take = (slice(lo - a, hi - a), *(slice(r.start, r.stop) for r in box[1:]))
                        out[lo - box[0].start : hi - box[0].start] = rows[take]

        return read, 1

    def read_selection(self, leaf: StoredLeaf, selection: Selection) -> np.ndarray:
        """The stored values that ``selection`` takes of one leaf, as stored (its dtype; for
        PRNG keys, key data), checked as a restore checks them. What `LazyArray.get` reads.

        This reads the leaf whole and selects from it; a format that can read less
        (eqxckpt's chunks, safetensors' byte ranges) overrides it.

        **Arguments:**

        - `leaf`: a `StoredLeaf` of this source.
        - `selection`: a basic index of its stored shape, normalised (what indexing a
          `LazyArray` makes).

        **Returns:** a numpy array of the selection's shape.

        ```python
        ckpt["model/w"][1:3, 0].get()  # np.array([3.0, 6.0])
        ```
        """
        found: list[np.ndarray] = []
        reserve = lambda nbytes: check_allocation(nbytes, f"Reading leaf {leaf.path!r} of {self.location}")  # noqa: E731
        with reading(leaf):
            self._fetch([leaf], lambda _, data: found.append(data), reserve)
        check_bool_bytes(found[0], leaf.path)
        return selection.take(found[0])

    def prepare_reads(self, leaves: Sequence[StoredLeaf]) -> None:  # noqa: B027 - most formats need nothing
        """Get ready to read parts of ``leaves`` (`read_into`, `read_selection`) many times, as
        a `Stack` or `Unstack` restore does: an eqxckpt checkpoint reads and checks their chunk
        layouts at once, concurrently; other formats need nothing.

        **Arguments:**

        - `leaves`: `StoredLeaf`s of this source.

        **Returns:** nothing.

        ```python
        ckpt.prepare_reads([ckpt.leaf("model/w"), ckpt.leaf("model/b")])
        ```
        """

    def read_into(self, leaf: StoredLeaf, region: Region, out: np.ndarray) -> None:
        """Fill ``out`` with the stored values of a box of one leaf, checked as a restore
        checks them: what a `Stack` or `Unstack` restore reads each layer, or window of
        rows, with. A format that can, reads straight into ``out`` (eqxckpt's chunks,
        safetensors' rows); this reads the selection (`read_selection`) and copies it.

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
        self._read_into(leaf, checked_region(leaf, region, out), out)

    def _read_into(self, leaf: StoredLeaf, region: Region, out: np.ndarray) -> None:
        """`read_into` of a region checked to lie within the leaf (slices of ints, step 1) and an
        ``out`` checked to fit it. A format that can read straight into ``out`` overrides this."""
        out[...] = self.read_selection(leaf, Selection.of(region, leaf.data_shape))

    def part_reader(self, leaf: StoredLeaf, selection: Selection) -> Callable[[Region], np.ndarray]:
        """What a save copies a selection of one leaf from, a part at a time: a function of
        a part of the selection (a tuple of slices from 0) giving its stored values.

        This reads the selection once (`read_selection`) and hands out parts of it; an
        eqxckpt checkpoint reads only the chunks each part needs.

        **Arguments:**

        - `leaf`, `selection`: as for `read_selection`.

        **Returns:** the function, which may be called from several threads at once.

        ```python
        ckpt["model/w"].part_reader()((slice(0, 1), slice(0, 3)))  # np.array([[0.0, 1.0, 2.0]])
        ```
        """
        data = self.read_selection(leaf, selection)
        return lambda part: data[part]

    def rows_per_read(self, leaf: StoredLeaf) -> int:
        """How many leading rows of ``leaf`` a `read_selection` reads at the least, however
        few it selects (a selection starting at a multiple of it). An `Unstack` restore
        reads a stacked leaf's rows in windows of multiples of it, so each row is read once.

        This format reads a leaf whole whatever is selected: all its rows. eqxckpt
        checkpoints read a chunk's rows, safetensors files one row.

        **Arguments:**

        - `leaf`: a `StoredLeaf` of this source with at least one dimension.

        **Returns:** a positive int.

        ```python
        ckpt.rows_per_read(ckpt.leaf("model/w"))  # 4: its chunk holds every row
        ```
        """
        return max(1, leaf.shape[0]) if leaf.shape else 1

    def _fetch(
        self, leaves: Sequence[StoredLeaf], done: Callable[[int, np.ndarray], None], reserve: Callable[[int], None]
    ) -> None:
        """Read each of ``leaves`` whole, as stored (its dtype, its ``data_shape``), and call
        ``done(i, data)`` for each, in any order; call ``reserve(nbytes)`` with the bytes it
        will hold before it allocates them (once the files were checked to hold them).
        Failures may be raised as they are: `read` names the leaf."""
        raise NotImplementedError(f"{type(self).__name__} reads through another source.")

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
        out = {}
        for path, leaf in self._leaves.items():
            rel = relative_to(path, prefix)
            if rel is not None:
                out[rel] = leaf
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
