"""`diff`: what differs between two checkpoints, leaf by leaf, reading only what it must."""

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from .._arguments import checked_arguments
from .._errors import plural
from .._formats._open import open as open_source
from .._leaf import Leaf, ScalarLeaf, StoredLeaf
from .._progress import Progress, advance, reporting
from .._read._checkpoint import Checkpoint
from .._read._lazy import LazyArray
from .._read._source import Source
from .._storage import CheckpointPath
from .._tree import is_prng_key_dtype
from .._window import SLAB_BYTES


@dataclasses.dataclass
class ChangedLeaf:
    """A leaf whose value changed: the largest absolute difference ``|a - b|`` and relative
    difference ``|a - b| / |b|`` over its elements (``inf`` where ``b`` is 0 and ``a`` is
    not; ``nan`` where exactly one side is NaN; None for values that are not numbers).

    ```python
    eqxckpt.save("ckpt_later", {"model": {"w": np.zeros((4, 3), np.float32)}})
    [(c.leaf_path, c.max_abs) for c in eqxckpt.diff("ckpt", "ckpt_later", at="model").changed]  # [('w', 11.0)]
    ```
    """

    leaf_path: str
    max_abs: float | None
    max_rel: float | None


@dataclasses.dataclass
class Diff:
    """What `diff` found: leaf paths added (only in ``b``), removed (only in ``a``),
    retyped (``(path, a's description, b's)``: another shape, dtype or kind), changed
    in value, and unchanged; with the bytes it read to tell.

    ```python
    result = eqxckpt.diff("ckpt", "ckpt")
    assert result.same and result.bytes_read == 0  # equal digests: nothing read
    ```
    """

    a: str
    b: str
    added: list[str] = dataclasses.field(default_factory=list)
    removed: list[str] = dataclasses.field(default_factory=list)
    retyped: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    changed: list[ChangedLeaf] = dataclasses.field(default_factory=list)
    unchanged: list[str] = dataclasses.field(default_factory=list)
    bytes_read: int = 0

    @property
    def same(self) -> bool:
        """Whether every leaf is in both, unchanged.

        **Returns:** True when nothing differs.

        ```python
        assert eqxckpt.diff("ckpt", "ckpt").same
        ```
        """
        return not (self.added or self.removed or self.retyped or self.changed)

    def __str__(self) -> str:
        head = (
            f"{self.a} -> {self.b}: {len(self.unchanged)} unchanged, {len(self.changed)} changed, "
            f"{len(self.retyped)} retyped, {len(self.added)} added, {len(self.removed)} removed "
            f"({plural(self.bytes_read, 'byte')} read)"
        )
        lines = [f"  + {path}" for path in self.added] + [f"  - {path}" for path in self.removed]
        lines += [f"  ~ {path}: {was} -> {now}" for path, was, now in self.retyped]
        lines += [f"  * {c.leaf_path}: max abs {c.max_abs}, max rel {c.max_rel}" for c in self.changed]
        return "\n".join([head, *lines])


@checked_arguments
def diff(
    a: CheckpointPath | Source,
    b: CheckpointPath | Source,
    *,
    at: str | None = None,
    progress: Progress = "auto",
) -> Diff:
    """Compare two checkpoints leaf by leaf: added, removed, retyped, changed and unchanged.

    Leaves whose digests both checkpoints record (eqxckpt writes one per stored
    leaf) are equal or not without reading a byte; only the changed ones are
    read, to say by how much. Leaves without digests (older checkpoints,
    safetensors, Orbax, TensorFlow) are read on both sides and compared byte
    for byte. Large eqxckpt leaves are read a slab at a time, small ones in
    batches, so that each chunk of the array small leaves are packed in is
    read once. Scalars are compared by their bits, as arrays are: ``0.0`` and
    ``-0.0`` differ, and so do NaNs of another sign or payload.

    **Arguments:**

    - `a`, `b`: the checkpoints, as for `eqxckpt.open` (any format, mixed), or
      sources already opened.
    - `at`: compare only the subtree under this path prefix (in both).
    - `progress`: as for `eqxckpt.save` (a bar of the bytes read).

    **Returns:** a `Diff`.

    ```python
    eqxckpt.save("ckpt_later", {"model": {"w": np.zeros((4, 3), np.float32)}})
    result = eqxckpt.diff("ckpt", "ckpt_later")
    result.removed, [c.leaf_path for c in result.changed]  # (['model/b', 'opt_state/mu'], ['model/w'])
    ```
    """
    source_a = a if isinstance(a, Source) else open_source(a)
    source_b = b if isinstance(b, Source) else open_source(b)
    result = Diff(str(source_a.location), str(source_b.location))
    leaves_a, leaves_b = source_a.records(at), source_b.records(at)
    result.removed = [path for path in leaves_a if path not in leaves_b]
    result.added = [path for path in leaves_b if path not in leaves_a]
    to_read: list[tuple[str, StoredLeaf, StoredLeaf]] = []
    for path, leaf_a in leaves_a.items():
        leaf_b = leaves_b.get(path)
        if leaf_b is None:
            continue
        if _retyped(leaf_a, leaf_b):
            result.retyped.append((path, leaf_a.describe(), leaf_b.describe()))
        elif isinstance(leaf_a, StoredLeaf) and isinstance(leaf_b, StoredLeaf):
            if leaf_a.digest is not None and leaf_a.digest == leaf_b.digest:
                result.unchanged.append(path)
            else:
                to_read.append((path, leaf_a, leaf_b))
        elif isinstance(leaf_a, ScalarLeaf) and isinstance(leaf_b, ScalarLeaf):
            difference = _scalar_difference(leaf_a.value(), leaf_b.value())
            if difference.identical:
                result.unchanged.append(path)
            else:
                result.changed.append(ChangedLeaf(path, difference.max_abs, difference.max_rel))
        elif _same_record(leaf_a, leaf_b):
            result.unchanged.append(path)
        else:
            result.changed.append(ChangedLeaf(path, None, None))
    total = sum(leaf_a.nbytes + leaf_b.nbytes for _, leaf_a, leaf_b in to_read)
    with (
        source_a.consistent(),
        source_b.consistent(),
        # Leaves read on both sides: each pair counts twice.
        reporting(f"comparing {result.a} with {result.b}", total, 2 * len(to_read), progress),
    ):
        found: dict[str, _Difference] = {}
        for (path, leaf_a, _), blocks in _compared(source_a, source_b, to_read):
            found[path] = difference = _Difference(numbers=leaf_a.kind == "array")
            for block_a, block_b in blocks:
                difference.add(block_a, block_b)
                result.bytes_read += block_a.nbytes + block_b.nbytes
    for path, _, _ in to_read:  # in a's order, whatever order they were read in
        difference = found[path]
        if difference.identical:
            result.unchanged.append(path)
        else:
            result.changed.append(ChangedLeaf(path, difference.max_abs, difference.max_rel))
    return result


def _retyped(a: Leaf, b: Leaf) -> bool:
    """Another kind, or for arrays another shape or dtype, or for scalars another type."""
    if a.kind != b.kind:
        return True
    if isinstance(a, ScalarLeaf) and isinstance(b, ScalarLeaf):
        return a.type_name != b.type_name
    return isinstance(a, StoredLeaf) and a.describe() != b.describe()


def _same_record(a: Leaf, b: Leaf) -> bool:
    """Leaves with no value of their own (functions, classes) are the same record."""
    return a.to_json() | {"path": None, "keys": None} == b.to_json() | {"path": None, "keys": None}


def _scalar_difference(x: Any, y: Any) -> "_Difference":
    """Two scalars of one type compared as the 0-d arrays numpy makes of them (bool, int64,
    float64, complex128): by their bits, as stored arrays are, so that ``0.0`` and ``-0.0``
    differ, and NaNs of another sign or payload, for scalars as for arrays. Strings, None
    and ints no numpy integer holds are compared by value."""
    numbers = isinstance(x, (int, float, complex)) and isinstance(y, (int, float, complex))
    difference = _Difference(numbers=numbers)
    a, b = np.asarray(x), np.asarray(y)
    if numbers and a.dtype == b.dtype and a.dtype != object:
        difference.add(a, b)
    elif x != y:
        difference.identical = False
        if numbers:  # huge ints: their exact gap, as a float
            gap = abs(x - y)
            try:
                difference.max_abs, difference.max_rel = float(gap), float(gap / abs(y)) if y else math.inf
            except OverflowError:
                difference.max_abs = difference.max_rel = math.inf
    return difference


Pair = tuple[str, StoredLeaf, StoredLeaf]


def _compared(source_a: Source, source_b: Source, pairs: list[Pair]) -> Iterator[tuple[Pair, Any]]:
    """Each pair with its data on both sides, as ``(block_a, block_b)`` host arrays in C order.

    Large eqxckpt leaves come a slab of rows at a time. The others are read in batches
    of about `SLAB_BYTES` per side, each batch in one read of each source: a batch of
    packed leaves reads every chunk of the packed array that holds them once, where
    reading them one by one would read a whole chunk for each.
    """
    whole: list[Pair] = []
    for pair in pairs:
        if _slabbed(source_a[pair[1].path]) and _slabbed(source_b[pair[2].path]):
            yield pair, _slabs(source_a[pair[1].path], source_b[pair[2].path])
        else:
            whole.append(pair)
    # In the order of a's packed array (b's, saved from the same tree, mostly follows),
    # so that the leaves sharing a chunk share a batch.
    whole.sort(key=lambda pair: (pair[1].location, pair[1].offset or 0))
    for batch in _batches(whole):
        values_a = source_a.read([(leaf_a, leaf_a.host_target()) for _, leaf_a, _ in batch])
        values_b = source_b.read([(leaf_b, leaf_b.host_target()) for _, _, leaf_b in batch])
        for pair, value_a, value_b in zip(batch, values_a, values_b):
            yield pair, [(_host(value_a), _host(value_b))]


def _batches(pairs: list[Pair]) -> Iterator[list[Pair]]:
    """``pairs`` in runs of at most `SLAB_BYTES` a side (a larger leaf alone)."""
    batch: list[Pair] = []
    nbytes = 0
    for pair in pairs:
        size = max(pair[1].nbytes, pair[2].nbytes)
        if batch and nbytes + size > SLAB_BYTES:
            yield batch
            batch, nbytes = [], 0
        batch.append(pair)
        nbytes += size
    if batch:
        yield batch


def _slabbed(entry: Any) -> bool:
    """Whether a leaf is read a slab of rows at a time: eqxckpt's large sliceable arrays."""
    return (
        isinstance(entry, LazyArray)
        and isinstance(entry.source, Checkpoint)
        and entry.nbytes > SLAB_BYTES
        and bool(entry.shape)
        and entry.leaf.sliceable
    )


def _slabs(a: LazyArray, b: LazyArray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Two arrays of one shape and dtype, a slab of rows of each at a time."""
    rows = max(1, SLAB_BYTES // max(1, a.nbytes // a.shape[0]))
    for start in range(0, a.shape[0], rows):
        block_a, block_b = a[start : start + rows].get(), b[start : start + rows].get()
        advance(block_a.nbytes + block_b.nbytes, 0)
        yield block_a, block_b
    advance(0, 2)


def _host(value: Any) -> np.ndarray:
    """A value `Source.read` gave, as host data: a PRNG key array's key data."""
    return np.asarray(jax.random.key_data(value) if is_prng_key_dtype(value.dtype) else value)


class _Difference:
    """The running comparison of one leaf's blocks."""

    def __init__(self, numbers: bool) -> None:
        self.identical = True
        # PRNG keys' data and the like are equal or not, at no distance.
        self.max_abs: float | None = 0.0 if numbers else None
        self.max_rel: float | None = 0.0 if numbers else None

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        if a.dtype != b.dtype or a.shape != b.shape:  # cannot happen for leaves described alike
            raise AssertionError((a.dtype, b.dtype, a.shape, b.shape))
        if np.array_equal(_bytes_of(a), _bytes_of(b)):  # compared in place, no copies
            return
        self.identical = False
        if self.max_abs is None or self.max_rel is None:
            return
        wide = np.complex128 if np.iscomplexobj(a) else np.float64
        x, y = a.astype(wide).reshape(-1), b.astype(wide).reshape(-1)  # 0-d arrays too
        # inf - inf is NaN; x / 0, overflows and x / tiny are inf: as they should be.
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            gap = np.abs(x - y)
            gap[np.isnan(x) & np.isnan(y)] = 0.0  # NaN in both: unchanged there
            rel = np.where(gap == 0, 0.0, gap / np.abs(y))
        self.max_abs = max(self.max_abs, float(np.max(gap)) if gap.size else 0.0)
        self.max_rel = max(self.max_rel, float(np.max(rel)) if rel.size else 0.0)
        if gap.size and np.isnan(gap).any():
            self.max_abs = self.max_rel = math.nan


def _bytes_of(data: np.ndarray) -> np.ndarray:
    """``data``'s bytes as a flat uint8 view (a copy only if it is not contiguous)."""
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
