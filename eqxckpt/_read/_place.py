"""`Placement`: one leaf put on its devices a band of rows at a time, so that the host
holds at most the result's own host memory plus the host memory budget (and a chunk);
blocks of a sharding (`slice_key`, `held_blocks`, `held_by`), the one assembly of a
global array (`global_array`), and a leaf's digest fed as its blocks are placed
(`PlacedDigest`).

A leaf is read as this process's distinct blocks (one per slice its sharding gives:
replicas share theirs). On CPU devices the blocks are the result itself: read straight
into aligned host buffers that the devices keep without a copy (`jax.device_put`), and
where a cast is asked for, each band of rows is read and cast into them. Other devices'
blocks are built on the device: each band is read into host memory, cast there, put on
the block's devices and written into a buffer allocated there first, by a
``dynamic_update_slice`` that donates the buffer (in place, no second copy).
"""

import functools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._digest import LeafDigest, Tiled
from .._formats._convert import aligned_empty

if TYPE_CHECKING:
    import jax

    from .._leaf import StoredLeaf

# What fills host buffers with boxes of a leaf: ``read(pairs, window)``, each pair a box
# (one range per dimension of the stored shape) and a C-contiguous buffer shaped like
# it; ``window``: the bytes of reads it may keep in flight.
Reader = Callable[[Sequence[tuple[tuple[range, ...], np.ndarray]], int], None]

# A cast converts a band this much of the result at a time (`Placement._slices`).
CAST_SLICE_BYTES = 16 << 20
# Treat CPU devices as any other device's: blocks built on the device band by band.
# Private: what lets tests check the path a GPU takes on a machine without one.
STAGE_CPU = False


# A block of an array: (start, stop) on each dimension.
Block = tuple[tuple[int, int], ...]


def slice_key(index: Any, shape: tuple[int, ...]) -> Block:
    """A hashable, normalised form of an index into ``shape``: the block it selects
    (dimensions the index leaves out are whole)."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape)) + tuple((0, n) for n in shape[len(index) :])


def block_holders(sharding: "jax.sharding.Sharding", shape: tuple[int, ...]) -> dict[Block, tuple[int, ...]]:
    """Every distinct block of an array of ``shape`` laid out by ``sharding``, and the
    processes whose devices hold it (ascending): the same in every process.

    ```python
    block_holders(NamedSharding(mesh, P("x")), (8, 3))  # {((0, 4), (0, 3)): (0,), ((4, 8), (0, 3)): (1,)}
    ```
    """
    holders: dict[Block, set[int]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        holders.setdefault(slice_key(index, shape), set()).add(device.process_index)
    return {block: tuple(sorted(who)) for block, who in holders.items()}


def held_blocks(
    sharding: "jax.sharding.Sharding", shape: tuple[int, ...], stored: tuple[int, ...] | None = None
) -> list[Block]:
    """The distinct blocks of an array of ``shape`` laid out by ``sharding`` that this
    process's devices hold (replicas share theirs), in the sharding's device order, as
    blocks of its ``stored`` shape (a PRNG key array's key data's: whole trailing dimensions).

    ```python
    held_blocks(NamedSharding(mesh, P("x")), (8, 3))  # [((0, 4), (0, 3)), ((4, 8), (0, 3))]
    ```
    """
    stored = shape if stored is None else stored
    indices = sharding.addressable_devices_indices_map(shape).values()
    return list(dict.fromkeys(slice_key(index, stored) for index in indices))


def block_of(box: Sequence[range]) -> Block:
    """The block a box of ranges (step 1) selects."""
    return tuple((r.start, r.stop) for r in box)


def bounding_block(blocks: Sequence[Block]) -> Block:
    """The smallest block holding every one of ``blocks``.

    ```python
    bounding_block([((0, 2), (0, 3)), ((2, 4), (1, 3))])  # ((0, 4), (0, 3))
    ```
    """
    return tuple((min(b[d][0] for b in blocks), max(b[d][1] for b in blocks)) for d in range(len(blocks[0])))


def region_of(block: Block, within: Block | None = None) -> tuple[slice, ...]:
    """``block`` as slices, relative to the start of ``within`` (a block holding it)."""
    starts = [0] * len(block) if within is None else [a for a, _ in within]
    return tuple(slice(a - s, b - s) for (a, b), s in zip(block, starts))


def inside(inner: Block, outer: Block) -> bool:
    """Whether block ``inner`` lies within block ``outer``."""
    return all(o0 <= i0 and i1 <= o1 for (i0, i1), (o0, o1) in zip(inner, outer))


def on_host(devices: Any) -> bool:
    """Whether arrays on ``devices`` live in host memory (CPU devices) and keep a host buffer put on them."""
    return not STAGE_CPU and all(device.platform == "cpu" for device in devices)


class Placement:
    """How one leaf of stored shape ``shape`` goes onto ``sharding``'s devices in this
    process: its distinct blocks, their devices, and the bands of rows it is read in.
    Made before any read, so a sharding that does not fit the shape fails as JAX says.

    **Arguments:**

    - `shape`: the stored shape (a PRNG key array's key data's).
    - `sharding`: the target's sharding.
    - `stored`, `dtype`: the stored dtype, and the dtype of the result.
    - `budget`: the host memory the bands (and reads in flight) may hold.
    """

    def __init__(
        self,
        shape: tuple[int, ...],
        sharding: "jax.sharding.Sharding",
        stored: np.dtype,
        dtype: np.dtype,
        budget: int,
    ):
        self.shape, self.sharding, self.stored, self.dtype = shape, sharding, stored, dtype
        self.devices: dict[tuple, list[Any]] = {}  # block -> its devices, in the sharding's order
        self.order: list[tuple[Any, tuple]] = []
        for device, index in sharding.addressable_devices_indices_map(shape).items():
            key = slice_key(index, shape)
            self.devices.setdefault(key, []).append(device)
            self.order.append((device, key))
        self.host = on_host(device for device, _ in self.order)
        # Straight into the result: nothing staged, the reads' window is the caller's.
        self.direct = self.host and dtype == stored
        # A band holds the stored bytes; a cast converts it a `CAST_SLICE_BYTES` slice at a time.
        self._per_element = stored.itemsize
        self._budget = budget // 2  # the bands'; the rest, the reads in flight into them
        self.window = max(1, budget - budget // 2)

    def _bands(self, budget: int, per_element: int, align: int) -> list[tuple[int, int]]:
        """Row ranges whose blocks' parts hold at most ``budget`` bytes together, in
        multiples of ``align`` rows (a chunk's: each chunk is read once), at least that many."""
        if not self.shape or 0 in self.shape:
            return [(0, self.shape[0] if self.shape else 1)]
        row_cost = {key: math.prod(b - a for a, b in key[1:]) * per_element for key in self.devices}
        # The most any one row costs: rows where the most blocks overlap.
        per_row = max(sum(c for k, c in row_cost.items() if k[0][0] <= key[0][0] < k[0][1]) for key in self.devices)
        band = max(1, budget // max(1, per_row))
        # Whole chunks' rows, each chunk then read once: a band of one chunk's rows at the
        # least, which the host may hold beside the budget (one chunk).
        band = max(align, band - band % align)
        total = self.shape[0]
        return [(start, min(total, start + band)) for start in range(0, total, band)]

    def run(
        self,
        convert: Callable[[np.ndarray], np.ndarray],
        read: Reader,
        window: int,
        rows: int = 1,
        seen: Callable[[Block, np.ndarray], None] | None = None,
    ) -> "jax.Array":
        """Read the leaf with ``read`` and put it on its devices.

        **Arguments:**

        - `convert`: a host array of the stored dtype (a band of a block, or a whole
          block) to the result's dtype, checked (it may return its argument).
        - `read`: what fills host buffers with boxes of the leaf (`Reader`).
        - `window`: the reads in flight where blocks are read straight into the result.
        - `rows`: bands start at multiples of this many rows where a band holds as many
          (a chunk's rows: each chunk is then read once).
        - `seen`: given each distinct block's stored data as it is read, ``(block, rows)``,
          each block's rows in order (and blocks side by side in the order of their
          first row): what digests the leaf as it is placed.

        **Returns:** the global array (of the stored shape) on the sharding's devices.
        """
        import jax

        if self.direct:
            blocks = {key: aligned_empty(_extent(key), self.stored) for key in self.devices}
            read([(_box(key), block) for key, block in blocks.items()], window)
            for key in sorted(blocks):
                convert(blocks[key])  # checks only: the dtypes are the same
                if seen is not None:
                    seen(key, blocks[key])
            # Aligned: a CPU device keeps the buffer (replicas share it).
            arrays = [jax.device_put(blocks[key], device) for device, key in self.order]
            return global_array(self.shape, self.sharding, arrays, self.dtype)
        sinks = {key: _Block(_extent(key), self.dtype, devices, self.host) for key, devices in self.devices.items()}
        for start, stop in self._bands(self._budget, self._per_element, max(1, rows)):
            pieces = []
            for key in self.devices:
                lo, hi = (start, stop) if not key else (max(start, key[0][0]), min(stop, key[0][1]))
                if key and lo >= hi and key[0][0] != key[0][1]:
                    continue  # another band's rows (an empty block takes the first band)
                box = (range(lo, hi), *_box(key)[1:]) if key else ()
                # Aligned: a CPU device keeps it rather than copying it (`STAGE_CPU`).
                out = aligned_empty(tuple(map(len, box)), self.stored)
                pieces.append((key, lo - (key[0][0] if key else 0), box, out))
            read([(box, out) for _, _, box, out in pieces], self.window)
            for key, at, _, out in sorted(pieces, key=lambda piece: piece[0]):
                if seen is not None:
                    seen(key, out)
                for first, part in self._slices(out):
                    sinks[key].put(at + first, convert(part))
            del pieces  # the band's host memory goes before the next is read
        arrays = [sinks[key].array(device) for device, key in self.order]
        return global_array(self.shape, self.sharding, arrays, self.dtype)

    def _slices(self, out: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """``out`` (a band of a block) as ``(first row, rows)`` slices to convert one at a
        time: a cast holds one slice's result (and checks) beside the band, not the band's."""
        if self.dtype == self.stored or out.ndim == 0 or not out.size:
            return [(0, out)]
        row = max(1, out[0].size * (self.dtype.itemsize + 2))
        rows = max(1, CAST_SLICE_BYTES // row)
        return [(first, out[first : first + rows]) for first in range(0, len(out), rows)]


def _extent(key: tuple) -> tuple[int, ...]:
    return tuple(b - a for a, b in key)


def _box(key: tuple) -> tuple[range, ...]:
    return tuple(range(a, b) for a, b in key)


@functools.cache
def _update() -> Callable[..., "jax.Array"]:
    """Rows of a device buffer replaced in place: the buffer is donated, so XLA writes
    into it. Compiled once per buffer and band shape (and device), not per band."""
    import jax

    def update(buffer: jax.Array, band: jax.Array, at: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(buffer, band, at, axis=0)

    return jax.jit(update, donate_argnums=0)


@functools.cache
def _zeros() -> Callable[..., "jax.Array"]:
    """A buffer of zeros made on the device itself (``jnp.zeros(..., device=)`` outside a
    jit makes it on the default device and copies it over)."""
    import jax
    import jax.numpy as jnp

    def zeros(shape: tuple[int, ...], dtype: np.dtype, device: Any) -> jax.Array:
        return jnp.zeros(shape, dtype, device=jax.sharding.SingleDeviceSharding(device))

    return jax.jit(zeros, static_argnums=(0, 1, 2))


class _Block:
    """One block of the result, filled band by band: in host memory for CPU devices (the
    buffer they keep), else on each of its devices."""

    def __init__(self, extent: tuple[int, ...], dtype: np.dtype, devices: list[Any], host: bool):
        self.extent, self.dtype, self.devices, self.host = extent, dtype, devices, host
        self.buffer = aligned_empty(extent, dtype) if host else None
        self.on: dict[Any, Any] = {}

    def put(self, at: int, band: np.ndarray) -> None:
        import jax

        if self.buffer is not None:
            if self.extent:
                self.buffer[at : at + len(band)] = band
            else:
                self.buffer[...] = band
            return
        whole = band.shape == self.extent  # one band: it is the block
        for device in self.devices:
            placed = jax.device_put(band, device)
            if not whole:
                if device not in self.on:
                    self.on[device] = _zeros()(self.extent, self.dtype, device)
                placed = _update()(self.on[device], placed, at)
            self.on[device] = placed
        # The band's host buffer may go once every device has its copy.
        jax.block_until_ready([self.on[device] for device in self.devices])

    def array(self, device: Any) -> "jax.Array":
        import jax

        if self.buffer is not None:
            return jax.device_put(self.buffer, device)
        if device not in self.on:  # an empty block no band wrote
            self.on[device] = _zeros()(self.extent, self.dtype, device)
        return self.on[device]


def global_array(shape: tuple[int, ...], sharding: Any, arrays: list[Any], dtype: Any) -> Any:
    """The global array of ``sharding`` from this process's devices' ``arrays`` (in the
    order of its addressable devices), each moved into the memory the sharding names (a
    host memory kind, for offloaded state) where it was built in its device's own; none
    where this process holds none of it (a leaf on other processes' devices only)."""
    import jax

    kind = sharding.memory_kind
    if kind is not None:
        arrays = [
            array
            if array.sharding.memory_kind == kind
            else jax.device_put(array, jax.sharding.SingleDeviceSharding(next(iter(array.devices())), memory_kind=kind))
            for array in arrays
        ]
    if not arrays:  # the dtype then cannot be taken from them
        return jax.make_array_from_single_device_arrays(shape, sharding, arrays, dtype=dtype)
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def held_by(leaf: Any) -> frozenset[int]:
    """The JAX processes whose devices hold ``leaf`` (an array or a `like` target), the
    same in every process for a global array; empty for one without a sharding (numpy)."""
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        return frozenset()
    return frozenset(device.process_index for device in sharding.device_set)


class PlacedDigest:
    """A leaf's digest fed by its `Placement` as it reads the leaf's blocks (`seen`), where
    they hold its stored bytes in an order the digest covers: a part's held blocks, each
    its own; or blocks that tile the leaf (one, when it is replicated), each band of rows
    hashed once its blocks side by side hold whole rows (blocks split by columns too).

    ```python
    digest = PlacedDigest.of(leaf, placement)
    placement.run(convert, read, window, seen=digest); digest.check()
    ```
    """

    def __init__(self, leaf: "StoredLeaf", digesting: LeafDigest, blocks: dict[Block, int] | None):
        self.leaf, self.digesting, self.blocks = leaf, digesting, blocks
        shape = leaf.data_shape
        self._row = math.prod(shape[1:]) if shape else 1  # elements of a whole row
        self._pending: list[tuple[Block, np.ndarray]] = []  # one band's pieces of the same rows, in order

    @classmethod
    def of(cls, leaf: "StoredLeaf", placement: Placement) -> "PlacedDigest | None":
        """The digest ``placement`` can feed for ``leaf``, or None where it reads other
        blocks (a part into a finer sharding; some blocks of a leaf held whole, the others
        on other processes) or none is recorded."""
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
        # Bands of rows, one after another, each once its blocks side by side hold whole
        # rows: their bytes arrive in the leaf's C order.
        return cls(leaf, digesting, None) if Tiled.tiles(shape, keys) else None

    def __call__(self, block: Block, data: np.ndarray) -> None:
        if self.blocks is not None:
            self.digesting.update(data, self.blocks[block])
            return
        if not block or block[0][1] - block[0][0] == 0:
            if not block:
                self.digesting.update(data)
            return
        # `Placement.run` gives a band's pieces sorted by block: those of the same rows come
        # one after another, left to right; once they hold whole rows, those rows are hashed.
        self._pending.append((block, data))
        if sum(math.prod(b - a for a, b in piece[1:]) for piece, _ in self._pending) < self._row:
            return
        pending, self._pending = self._pending, []
        if len(pending) == 1:  # whole rows already: no copy
            self.digesting.update(data)
            return
        rows = len(data)
        pieces = [(((0, rows), *piece[1:]), part) for piece, part in pending]
        self.digesting.update(Tiled((rows, *self.leaf.data_shape[1:]), pieces))

    def check(self) -> None:
        """Raise `CorruptCheckpointError` unless the bytes placed are the ones saved."""
        self.leaf.check_digest(self.digesting.value)
