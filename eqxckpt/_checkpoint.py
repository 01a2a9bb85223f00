"""`open` and `Checkpoint`: a read-only, lazy view of a committed eqxckpt checkpoint."""

import asyncio
import collections
import contextlib
import functools
import json
import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from ._chunks import ChunkLayout, Region, read_chunk
from ._convert import aligned_empty
from ._errors import CorruptCheckpointError
from ._leaf import KeyRecord, StoredLeaf, check_bool_bytes
from ._manifest import Manifest
from ._pack import packed_array, read_runs, unpack
from ._progress import advance
from ._source import LazyEntry, Source, check_allocation, reading
from ._storage import MAX_ZARR_JSON_BYTES, CheckpointPath, Pin, Storage, corrupt, resolve
from ._store import CHUNK_BYTES, read_spec, read_window, shared_context
from ._window import Task, run_windowed, windowed


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
        self._arrays = location.arrays(manifest)
        # Leaves an incremental save took unchanged from earlier checkpoints are in theirs.
        self._referenced = {ref: location.referenced(ref) for ref in manifest.references()}
        self._manifest = manifest
        self.metadata = manifest.metadata
        self._leaves = {leaf.path: leaf for leaf in manifest.leaves}
        self._packed = packed_array(manifest.leaves)  # the array small leaves are packed in, if any
        self._context = shared_context()
        self._pin = pin
        if pin is not None:
            weakref.finalize(self, pin.close)

    def _lazy(self, leaf: StoredLeaf) -> "LazyArray":
        return LazyArray(self, leaf)

    # -- reading -----------------------------------------------------------------

    def _open_array(self, leaf: StoredLeaf) -> ts.Future:
        """Start opening a leaf's stored array: reads its ``zarr.json`` (at most
        `MAX_ZARR_JSON_BYTES`); `_open_checked` validates it and opens the array."""
        return self._arrays_of(leaf).read_leaf_metadata(leaf)

    def _arrays_of(self, leaf: StoredLeaf) -> Storage:
        """Where the leaf's array is: this checkpoint's arrays, or an earlier one's."""
        return self._arrays if leaf.arrays is None else self._referenced[leaf.arrays]

    def _checked_metadata(self, leaf: StoredLeaf, opened: ts.Future) -> dict[str, Any]:
        """The leaf's ``zarr.json`` (being read by ``opened``), checked to be what eqxckpt
        writes for what the manifest says. What was checked is what is used: chunks are
        read by the layout it gives, and TensorStore opens the array from it alone."""
        with reading(leaf):
            raw = opened.result()
        if raw is None:
            raise corrupt(leaf, "its zarr.json is missing")
        return validate_array_metadata(raw, leaf)

    def _layout(self, leaf: StoredLeaf) -> ChunkLayout:
        return ChunkLayout.stored(leaf, self._checked_metadata(leaf, self._open_array(leaf)))

    def _open_store(self, leaf: StoredLeaf, metadata: dict[str, Any]) -> ts.TensorStore:
        """The array as a TensorStore, for reads of slices of it (lazy indexing, sharded restores)."""
        with reading(leaf):
            spec = read_spec(self._arrays_of(leaf).child(leaf.path), metadata)
            return ts.open(spec, context=self._context, read=True).result()

    def _open_leaf(self, leaf: StoredLeaf) -> ts.TensorStore:
        return self._open_store(leaf, self._checked_metadata(leaf, self._open_array(leaf)))

    @functools.cached_property
    def _packed_layout(self) -> ChunkLayout:
        """The packed array's layout, its metadata (and its files) checked once for every read of it."""
        assert self._packed is not None
        return self._layout(self._packed)

    def _chunk_reads(
        self, record: StoredLeaf, layout: ChunkLayout, region: Region | None, out: np.ndarray, done: Callable[[], None]
    ) -> list[Task]:
        """Tasks that read the chunks of ``region`` (None: all; chunk-aligned) of ``record``'s
        array into ``out`` (shaped like it), checking each one's checksum, then call ``done``."""
        files = self._arrays_of(record).chunk_files()
        parts = layout.regions(region)
        origin = [0] * len(layout.shape) if region is None else [s.start for s in region]
        tasks: list[Task] = []
        for n, (key, part) in enumerate(parts):
            into = out[(*(slice(p.start - o, p.stop - o) for p, o in zip(part, origin)), ...)]  # a view, even 0-d

            def work(key: str = key, part: Region = part, into: np.ndarray = into) -> None:
                with reading(record):
                    read_chunk(files, f"{record.path}/{key}", layout, part, into)

            tasks.append((into.nbytes, work, (lambda _: done()) if n == len(parts) - 1 else None))
        return tasks or [(0, lambda: None, lambda _: done())]

    def _fetch(
        self, leaves: Sequence[StoredLeaf], done: Callable[[int, np.ndarray], None], reserve: Callable[[int], None]
    ) -> None:
        """Read each of ``leaves`` whole, as stored, calling ``done(i, data)`` in order: all
        their metadata at once, then their chunks straight into the final buffers within a
        `read_window`. Packed leaves are read as runs of the packed array's chunks, each once."""
        own = [i for i, leaf in enumerate(leaves) if leaf.offset is None]
        packed = [i for i, leaf in enumerate(leaves) if leaf.offset is not None]
        opens = [self._open_array(leaves[i]) for i in own]
        layouts = {i: ChunkLayout.stored(leaves[i], self._checked_metadata(leaves[i], o)) for i, o in zip(own, opens)}
        runs = []
        if packed:
            assert self._packed is not None  # a bad chunk names the packed array; verify names its leaves
            runs = read_runs([leaves[i] for i in packed], self._packed.shape[0], self._packed_layout.chunk[0])
        # Reserved once the files were checked: those must hold what the manifest declares.
        reserve(sum(leaves[i].nbytes for i in own) + sum(end - start for start, end, _ in runs))
        tasks: list[Task] = []
        for i in own:
            layout = layouts[i]
            buffer = aligned_empty(layout.shape, layout.dtype)  # aligned: the jax array adopts it
            tasks += self._chunk_reads(leaves[i], layout, None, buffer, lambda i=i, buffer=buffer: done(i, buffer))
        if packed:
            assert self._packed is not None
            layout = self._packed_layout
            for start, end, members in runs:
                indices = [packed[m] for m in members]
                buffer = aligned_empty((end - start,), np.dtype(np.uint8))

                def unpacked(start: int = start, buffer: np.ndarray = buffer, indices: list[int] = indices) -> None:
                    for i, data in zip(indices, unpack(buffer, start, [leaves[i] for i in indices])):
                        done(i, data)

                tasks += self._chunk_reads(self._packed, layout, (slice(start, end),), buffer, unpacked)
        run_windowed(tasks, read_window(sum(leaf.nbytes for leaf in leaves)))

    def _stored(self, leaf: StoredLeaf) -> np.ndarray:
        """One leaf's stored array, read whole."""
        found: list[np.ndarray] = []
        reserve = lambda nbytes: check_allocation(nbytes, f"Reading leaf {leaf.path!r}")  # noqa: E731
        self._fetch([leaf], lambda _, data: found.append(data), reserve)
        return found[0]

    def _read(self, wanted: Sequence[tuple[StoredLeaf, Any]]) -> list[Any]:
        """Read every selected leaf (see `Source._read` and `_fetch`). A target whose sharding
        spans several devices is read slice by slice instead, each on its own process."""
        sharded = {i for i, (leaf, target) in enumerate(wanted) if leaf.offset is None and _sharded(leaf, target)}
        whole = [i for i in range(len(wanted)) if i not in sharded]
        values: list[Any] = [None] * len(wanted)
        for i, value in zip(whole, super()._read([wanted[i] for i in whole])):
            values[i] = value
        # Sharded targets last, a leaf at a time, their slices read ahead within the window
        # and each placed on its device before it is let go: the host holds a window.
        window = read_window(sum(leaf.nbytes for leaf, _ in wanted))
        for i in sorted(sharded):
            leaf, target = wanted[i]
            with contextlib.closing(SliceReads(self, leaf, target, window)) as slices, reading(leaf):
                values[i] = leaf.assemble(target, slices, lambda index, shape=leaf.shape: _slice_key(index, shape))
            advance(leaf.nbytes)
        return values


def _sharded(leaf: StoredLeaf, target: Any) -> bool:
    """Whether to read ``target`` slice by slice: each device's slice, on its process."""
    sharding = getattr(target, "sharding", None)
    if sharding is None or (len(sharding.device_set) == 1 and sharding.is_fully_addressable):
        return False
    return leaf.can_shard(sharding)


def _slice_key(index: tuple, shape: tuple[int, ...]) -> tuple:
    """A hashable, normalised form of an index into ``shape``."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


class SliceReads:
    """The slices of one leaf that this process's devices hold, read ahead in the order
    the assembly asks for them, through the one window (`_window.windowed`). Slices are
    read as the chunk-aligned blocks that hold them: each stored chunk is read (and its
    checksum checked) once, however many devices' slices it holds."""

    def __init__(self, checkpoint: Checkpoint, leaf: StoredLeaf, target: Any, window: int):
        layout = checkpoint._layout(leaf)
        files = checkpoint._arrays_of(leaf).chunk_files()
        rank = len(leaf.shape)
        self._block: dict[tuple, tuple] = {}  # slice key -> the block read for it
        self._uses: collections.Counter = collections.Counter()  # block -> slices still to hand over
        for index in target.sharding.addressable_devices_indices_map(leaf.shape).values():
            key = _slice_key(index, leaf.shape)
            block = tuple(
                (start // c * c, min(n, -(-stop // c) * c))
                for (start, stop), c, n in zip(key, layout.chunk, leaf.shape)
            )
            self._block[key] = block
            self._uses[block] += 1
        order = list(self._uses)  # blocks, in the order their first slice is asked for

        def read(block: tuple) -> np.ndarray:
            region = (*(slice(start, stop) for start, stop in block), *(slice(0, n) for n in layout.shape[rank:]))
            out = np.empty(tuple(r.stop - r.start for r in region), layout.dtype)
            for key, part in layout.regions(region):
                into = out[(*(slice(p.start - r.start, p.stop - r.start) for p, r in zip(part, region)), ...)]
                read_chunk(files, f"{leaf.path}/{key}", layout, part, into)
            return out

        itemsize = layout.dtype.itemsize * math.prod(layout.shape[rank:])
        tasks = (
            (math.prod(b - a for a, b in block) * itemsize, lambda block=block: read(block), None) for block in order
        )
        self._reads = windowed(tasks, window)
        self._order = iter(order)
        self._held: dict[tuple, np.ndarray] = {}

    def __getitem__(self, key: tuple) -> np.ndarray:
        block = self._block[key]
        while block not in self._held:  # blocks arrive in the order they are first asked for
            _, self._held[next(self._order)] = next(self._reads)
        data = self._held[block]
        self._uses[block] -= 1
        if not self._uses[block]:  # every slice in it was handed over: let it go
            del self._held[block]
        return data[tuple(slice(start - b, stop - b) for (start, stop), (b, _) in zip(key, block))]

    def close(self) -> None:
        """Wait for the reads still in flight (an assembly that failed part-way)."""
        self._reads.close()


_ZARR_KEYS = {
    "zarr_format",
    "node_type",
    "shape",
    "data_type",
    "chunk_grid",
    "chunk_key_encoding",
    "fill_value",
    "codecs",
    "attributes",
    "dimension_names",
    "storage_transformers",
}


def validate_array_metadata(raw: bytes, record: StoredLeaf) -> dict[str, Any]:
    """A leaf's ``zarr.json``, checked against what eqxckpt writes for ``record``.

    Only the codec chain eqxckpt writes (raw little-endian bytes plus a crc32c
    checksum) and a regular grid of chunks of at most `CHUNK_BYTES` are
    accepted, so a crafted file can neither skip the checksum nor make a read
    allocate more than the array's own size plus one chunk.
    """

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"Leaf {record.path!r}: its zarr.json {why}. eqxckpt never writes that: the checkpoint is damaged or "
            "crafted; do not trust it.",
            leaf_path=record.path,
        )

    if len(raw) > MAX_ZARR_JSON_BYTES:
        raise bad(f"is over {MAX_ZARR_JSON_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise bad("is not valid JSON") from None
    if not isinstance(doc, dict):
        raise bad("is not a JSON object")
    if extra := sorted(set(doc) - _ZARR_KEYS):
        raise bad(f"has fields {extra}")
    if doc.get("zarr_format") != 3 or doc.get("node_type") != "array":
        raise bad("does not describe a zarr v3 array")
    shape = record.data_shape
    if doc.get("shape") != list(shape) or doc.get("data_type") != record.dtype:
        raise CorruptCheckpointError(
            f"Leaf {record.path!r} is corrupt: the manifest says {record.dtype}{list(shape)} but its zarr.json says "
            f"{doc.get('data_type')}{doc.get('shape')}. Restore the checkpoint from a copy or load an earlier one.",
            leaf_path=record.path,
        )
    grid = doc.get("chunk_grid")
    chunk = grid.get("configuration", {}).get("chunk_shape") if isinstance(grid, dict) else None
    if not (
        isinstance(grid, dict)
        and grid.get("name") == "regular"
        and isinstance(chunk, list)
        and len(chunk) == len(shape)
        and all(isinstance(c, int) and not isinstance(c, bool) and 1 <= c <= max(1, n) for c, n in zip(chunk, shape))
    ):
        raise bad(f"has a chunk grid {grid!r} that does not fit the shape {list(shape)}")
    if math.prod(chunk) * np.dtype(record.dtype).itemsize > CHUNK_BYTES:
        raise bad(f"has chunks of {chunk} (over {CHUNK_BYTES} bytes)")
    encoding = doc.get("chunk_key_encoding")
    if encoding not in ({"name": "default"}, {"name": "default", "configuration": {"separator": "/"}}):
        raise bad(f"has a chunk key encoding {encoding!r}")
    codecs = doc.get("codecs")
    little = {"name": "bytes", "configuration": {"endian": "little"}}
    if not (
        isinstance(codecs, list)
        and len(codecs) == 2
        and codecs[1] == {"name": "crc32c"}
        and (codecs[0] == little or (codecs[0] == {"name": "bytes"} and np.dtype(record.dtype).itemsize == 1))
    ):
        raise bad(f"has codecs {codecs!r}, not raw bytes with a crc32c checksum")
    if doc.get("storage_transformers", []) != []:
        raise bad("has storage transformers")
    return {
        key: doc[key]
        for key in ("shape", "data_type", "chunk_grid", "chunk_key_encoding", "codecs", "fill_value")
        if key in doc
    }


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
        if self._index == ():
            return shape
        return np.broadcast_to(np.empty((), np.int8), shape)[self._index].shape

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

        - `index`: a basic numpy index (ints, slices, ``...``), applied once.

        **Returns:** a `LazyArray`.

        ```python
        first_rows = ckpt["model/embedding"][:16].get()
        ```
        """
        if self._index != ():
            raise NotImplementedError("Index a LazyArray once; combine the indices into one expression.")
        if not self.leaf.sliceable:
            raise NotImplementedError(
                f"Leaf {self.leaf_path!r} ({self.leaf.describe()}) cannot be sliced lazily; get() the whole array."
            )
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

    def _view(self) -> ts.TensorStore:
        store = self.source._open_leaf(self.leaf)
        return store[self._index] if self._index != () else store

    def _stream(self) -> ts.TensorStore | np.ndarray:
        """The stored array as a TensorStore view from 0 (indexed and cast as this
        LazyArray is), to copy from without reading it all into memory; a
        packed leaf (small) is read whole."""
        if self.leaf.offset is not None:
            with reading(self.leaf):
                data = self._data()
            return data if self._dtype is None else data.astype(self._dtype)
        view = self._view().translate_to[0]
        return view if self._dtype is None else ts.cast(view, self._dtype)

    def _saved_as(self, path: str, keys: tuple[KeyRecord, ...]) -> StoredLeaf:
        """The leaf this array becomes when it is saved at ``path`` (copied from its checkpoint)."""
        changed = self._index != () or self._dtype is not None
        return self.leaf.copied(path, keys, tuple(self.shape), self.dtype, changed=changed)

    def _data(self) -> np.ndarray:
        """The selected stored values: the whole leaf read chunk by chunk (a packed one from
        the chunks holding it), a selection through TensorStore, which reads only the
        chunks it needs."""
        if self.leaf.offset is None and self._index != ():
            view = self._view()  # opened first: that checks the stored files hold what the manifest declares
            check_allocation(self.nbytes, f"Reading leaf {self.leaf_path!r}")
            return view.read().result()
        data = self.source._stored(self.leaf)
        check_bool_bytes(data, self.leaf.path)  # all of it: a selection could skip a damaged byte
        return data[self._index] if self._index != () else data

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


def open_checkpoint(path: CheckpointPath | Storage) -> Checkpoint:
    """An eqxckpt checkpoint, opened read-only without reading any array (`eqxckpt.open` for this format)."""
    location = resolve(path)
    manifest, pin = location.read_manifest()
    return Checkpoint(location, manifest, pin)
