"""`Source`, the read-only interface every readable checkpoint implements, and
`LazyArray`, one stored array of any source.

A source is a set of named leaves (`Leaf`: path, key records, shape and dtype
for arrays) with metadata, and a way to read the stored ones. eqxckpt
checkpoints (`Checkpoint`), TensorFlow checkpoints (`eqxckpt.t5`) and
translated views of either (`CheckpointTranslator.apply`) are sources, so
`load`, `Transform` and `CheckpointTranslator` work on all of them alike.
"""

import abc
import asyncio
import contextlib
import functools
import math
import operator
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .._chunks import Region
from .._digest import LeafDigest, Tiled
from .._errors import ArgumentError, CheckpointError
from .._formats._convert import Adoption, Adoptions
from .._leaf import Leaf, StoredLeaf, check_bool_bytes, refuse_narrowing
from .._paths import depth, did_you_mean, normalize_at, relative_to
from .._progress import advance
from .._storage import UNPINNED, Pin, reading
from .._tree import build_plain_tree
from .._window import check_allocation, host_memory_budget, read_window, start_jax
from ._place import Block, Placement, Reader, on_host
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
        return LazyArray(self, leaf) if isinstance(leaf, StoredLeaf) else leaf.value()


class PlacedDigest:
    """A leaf's digest fed by its `Placement` as it reads the leaf's blocks (`seen`), where
    they hold its stored bytes in an order the digest covers: a part's held blocks, each
    its own; or blocks of whole rows that tile the leaf (one, when it is replicated).

    ```python
    digest = PlacedDigest.of(leaf, placement)
    placement.run(convert, read, window, seen=digest); digest.check()
    ```
    """

    def __init__(self, leaf: StoredLeaf, digesting: LeafDigest, blocks: dict[Block, int] | None):
        self.leaf, self.digesting, self.blocks = leaf, digesting, blocks

    @classmethod
    def of(cls, leaf: StoredLeaf, placement: Placement) -> "PlacedDigest | None":
        """The digest ``placement`` can feed for ``leaf``, or None where it reads other
        blocks (a part into a finer sharding; columns of a whole leaf) or none is recorded."""
        digesting = leaf.digesting()
        keys = sorted(placement.devices)
        if digesting is None:
            return None
        if leaf.blocks is not None:
            return (
                cls(leaf, digesting, {b: n for n, b in enumerate(leaf.blocks)})
                if set(keys) == set(leaf.blocks)
                else None
            )
        shape = leaf.data_shape
        if not shape or 0 in shape:  # no bytes, or one: no order to keep
            return cls(leaf, digesting, None)
        # Bands of whole rows, one after another: their bytes arrive in the leaf's C order.
        whole_rows = all(key[1:] == tuple((0, n) for n in shape[1:]) for key in keys)
        return cls(leaf, digesting, None) if whole_rows and Tiled.tiles(shape, keys) else None

    def __call__(self, block: Block, data: np.ndarray) -> None:
        self.digesting.update(data, 0 if self.blocks is None else self.blocks[block])

    def check(self) -> None:
        """Raise `CorruptCheckpointError` unless the bytes placed are the ones saved."""
        self.leaf.check_digest(self.digesting.value)


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


def nothing_under(source: Source, at: str | None) -> CheckpointError:
    """The error for an ``at=`` that selects nothing: the closest paths as deep as it
    (``model/layer/0``: ``model/layers/0``), a hint where it is written with dots or
    brackets (``model.layers[0]``), and what is at the top level."""
    prefix = normalize_at(at)
    tops = sorted({path.split("/")[0] for path in source.paths})
    # Python's spelling of a key path (`jax.tree_util.keystr`, attribute access) into eqxckpt's.
    slashed = re.sub(r"\[['\"]?([^\]'\"]*)['\"]?\]", r".\1", prefix).strip(".").replace(".", "/")
    try:
        selects = slashed != prefix and bool(source.records(slashed))
    except CheckpointError:  # not a path at all ('model///w')
        selects = False
    if selects:  # offered only where it selects something
        hint = f" Paths use '/' between keys (at={slashed!r}, not at={prefix!r})."
    else:
        keys = depth(slashed)
        as_deep = {"/".join(path.split("/")[:keys]) for path in source.paths if depth(path) >= keys}
        hint = did_you_mean(slashed, as_deep)
        if slashed != prefix and "" not in slashed.split("/"):  # written with dots or brackets
            hint += " Paths use '/' between keys, not '.' or '[...]'."
    return CheckpointError(
        f"Nothing under at={at!r} in {source.location}.{hint} Its top-level entries are: {', '.join(tops) or 'none'}."
    )


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
