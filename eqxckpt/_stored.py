"""`StoredArrays`: the stored arrays of one committed eqxckpt checkpoint, and every read of them.

The one seam between a checkpoint's files and what reads them: `Checkpoint` and
`LazyArray` (values), `save` (incremental reuse) and `verify` (checks) all go
through its public methods. It owns the manifest, the storage, the prefixes the
manifest refers to, each leaf's checked chunk layout, chunk reads, leaf files, and
the pin that holds the checkpoint while it is read.
"""

import contextlib
import functools
import json
import math
import os
import weakref
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from ._chunk_reads import read_into, read_scattered
from ._chunks import ChunkLayout, Region
from ._dtypes import zarr_data_type
from ._errors import CheckpointError, CorruptCheckpointError
from ._formats._convert import aligned_empty
from ._leaf import ArrayLeaf, Leaf, StoredLeaf
from ._manifest import Manifest
from ._paths import MANIFEST_NAME
from ._storage import (
    MAX_ZARR_JSON_BYTES,
    UNPINNED,
    CheckpointPath,
    Pin,
    Storage,
    corrupt,
    expected_files,
    reading,
    resolve,
)
from ._window import SLAB_BYTES, Task, completed, host_memory_budget, read_window, run_windowed
from ._write._pack import PackedArray

# What `StoredArrays.scan` hands each slab of an array to: ``settle(block, start, bytes,
# failure, last)``.
Settle = Callable[[int, int, np.ndarray, CheckpointError | None, bool], None]


class StoredArrays:
    """The stored arrays of a committed checkpoint: what its manifest says, where
    each leaf's bytes are (its own arrays, or an earlier checkpoint's it refers to), and
    what holds it while it is read (`consistent`, `held`, `check_unchanged`).

    **Arguments:**

    - `storage`: the checkpoint's place.
    - `manifest`: its manifest, as read and checked.
    - `pin`: what ties it to the one whose manifest was read (`StoredArrays.open`);
      closed when this is collected.

    ```python
    stored = StoredArrays.open("ckpt")  # or eqxckpt.open("ckpt").stored
    stored.layout(stored.records["model/w"]).chunk  # its chunk shape, from its checked zarr.json
    ```
    """

    def __init__(self, storage: Storage, manifest: Manifest, pin: Pin = UNPINNED):
        self.storage = storage
        self.location = str(storage)  # as a user writes it
        self.manifest = manifest
        self._pin = pin
        weakref.finalize(self, pin.close)
        self.arrays = storage.arrays(manifest)
        # Leaves an incremental save took unchanged from earlier checkpoints are in theirs.
        self.referenced = {ref: storage.referenced(ref) for ref in manifest.references()}
        # Each record made when first looked up (a load of part of it makes only those).
        self.records: Mapping[str, Leaf] = manifest.by_path()
        self._prepared: dict[tuple[str, str | None], ChunkLayout] = {}  # `prepare_layouts`'

    @functools.cached_property
    def packing(self) -> PackedArray | None:
        """The array small leaves are packed in, if any: its members and their offsets."""
        return PackedArray.of(self.manifest.leaves)

    @property
    def packed(self) -> ArrayLeaf | None:
        """The packed array's record, if any."""
        return None if self.packing is None else self.packing.record

    @classmethod
    def open(cls, path: CheckpointPath | Storage) -> "StoredArrays":
        """The committed checkpoint at ``path``: its manifest read and checked, and pinned.

        **Arguments:**

        - `path`: where the checkpoint is (as for `eqxckpt.open`).

        **Returns:** its `StoredArrays`; nothing is read from its arrays yet.

        ```python
        StoredArrays.open("checkpoints/step_100").records["model/w"].shape
        ```
        """
        location = resolve(path)
        manifest, pin = location.read_manifest()
        return cls(location, manifest, pin)

    def consistent(self) -> contextlib.AbstractContextManager[None]:
        """Reads inside come from this checkpoint alone, or raise `CheckpointChangedError`
        (`Source.consistent`).

        **Returns:** a context manager.

        ```python
        with stored.consistent():
            stored.fetch([stored.records["model/w"]], print, lambda nbytes: None)
        ```
        """
        return self._pin.consistent(self.location)

    def held(self) -> contextlib.AbstractContextManager[None]:
        """On a local disk, a shared lock that keeps retention from deleting this checkpoint
        while the block runs; nothing is checked afterwards (`Source.held`).

        **Returns:** a context manager; entering it raises `CheckpointChangedError` if the
        checkpoint is gone already.

        ```python
        with stored.held():  # a save linking its files holds it so
            ...
        ```
        """
        return self._pin.held(self.location)

    def check_unchanged(self) -> None:
        """Raise `CheckpointChangedError` if the checkpoint was replaced or deleted since it
        was opened (`Source.check_unchanged`).

        ```python
        stored.check_unchanged()  # what was read so far is this checkpoint's
        ```
        """
        self._pin.check_unchanged(self.location)

    def stored_leaf(self, path: str) -> StoredLeaf | None:
        """The record of the leaf at ``path`` if it is a stored array, else None.

        **Arguments:**

        - `path`: a leaf path.

        **Returns:** its `StoredLeaf`, or None.

        ```python
        stored.stored_leaf("model/w").shape
        ```
        """
        record = self.records.get(path)
        return record if isinstance(record, StoredLeaf) else None

    def unlisted(self) -> list[tuple[str, str]]:
        """Files among the checkpoint's own arrays that its manifest does not name, as
        ``(path, why)`` problems (what `verify` reports)."""
        return self.arrays.unlisted(set(self.manifest.stored_paths()))

    def unwritten(self) -> list[str]:
        """Files here (on a local disk) that the save which made this checkpoint did not
        write: what `unlisted` names, and any file in a leaf's own directory beside its
        ``zarr.json`` and its chunks (or anything there that is not a plain file). What a
        deleter must leave alone: a leaf whose layout is damaged (which files are its
        cannot be told) is named whole."""
        found = [path for path, _ in self.unlisted()]
        own = [r for r in self.manifest.leaves if isinstance(r, StoredLeaf) and r.arrays is None and r.offset is None]
        for record in [*own, *([self.packed] if self.packed is not None else [])]:
            files = self.arrays.leaf_files(record.path)
            try:
                layout: ChunkLayout | None = self.layout(record)
            except CheckpointError:
                layout = None
            if files is None or layout is None:
                found.append(record.path)
                continue
            written = expected_files([(record, layout)])
            found.extend(sorted(key for key in files if key not in written))
        return found

    def sharers(self, leaf: StoredLeaf) -> list[str]:
        """The checkpoints beside this one that hold the very files ``leaf`` (one of its
        leaves, or the packed array) is stored in (`Storage.sharers`): damage to those files
        is damage to each of them.

        **Arguments:**

        - `leaf`: a stored leaf of this checkpoint, or its packed array's record.

        **Returns:** their names, in order; empty where none does.

        ```python
        stored.sharers(stored.records["model/w"])  # ['3', '5']
        ```
        """
        return self.storage.sharers(self.manifest, leaf)

    def mend(self, leaf: StoredLeaf, key: str, raw: bytes) -> None:
        """Rewrite the file ``key`` of ``leaf``'s array with ``raw`` (a verified twin's bytes)
        in place, in this checkpoint (never one that replaced it: `Storage.mend`). Call it
        inside `consistent`, which tells afterwards whether it was replaced meanwhile.

        ```python
        with stored.consistent():
            stored.mend(stored.records["w"], "w/c/0", good_bytes)
        ```
        """
        self.files_of(leaf).mend(key, raw, self._pin)

    def leaf_files(self, path: str) -> dict[str, int] | None:
        """The files of the leaf ``path`` among the checkpoint's own arrays with their sizes,
        on a local disk (None where they cannot be listed)."""
        return self.arrays.leaf_files(path)

    def open_metadata(self, leaf: StoredLeaf) -> ts.Future:
        """Start opening a leaf's stored array: reads its ``zarr.json`` (at most
        `MAX_ZARR_JSON_BYTES`); `_open_checked` validates it and opens the array."""
        return self.files_of(leaf).read_leaf_metadata(leaf)

    def files_of(self, leaf: StoredLeaf) -> Storage:
        """Where the leaf's array is: this checkpoint's arrays, or an earlier one's."""
        return self.arrays if leaf.arrays is None else self.referenced[leaf.arrays]

    def checked_metadata(self, leaf: StoredLeaf, opened: ts.Future) -> dict[str, Any]:
        """The leaf's ``zarr.json`` (being read by ``opened``), checked to be what eqxckpt
        writes for what the manifest says. What was checked is what is used: every read,
        whole or a selection, goes through the layout it gives (`_layout`)."""
        with reading(leaf):
            raw = opened.result()
        if raw is None:
            raise corrupt(leaf, "its zarr.json is missing")
        return validate_array_metadata(raw, leaf)

    def layout(self, leaf: StoredLeaf) -> ChunkLayout:
        prepared = self._prepared.get((leaf.path, leaf.arrays))
        if prepared is not None:
            return prepared
        metadata = self.checked_metadata(leaf, self.open_metadata(leaf))
        return ChunkLayout.stored(leaf, metadata)

    def prepare_layouts(self, leaves: Sequence[StoredLeaf]) -> None:
        """Read and check the chunk layouts of ``leaves`` (those with their own array) at once,
        their ``zarr.json`` reads in flight together, and keep them for later reads of parts
        of those leaves: opened one by one on the I/O threads, a `Stack` restore of 168 layers
        spent longer waiting for their metadata than reading their chunks."""
        wanted = [leaf for leaf in leaves if leaf.offset is None and (leaf.path, leaf.arrays) not in self._prepared]
        for leaf, opened in [(leaf, self.open_metadata(leaf)) for leaf in wanted]:
            self._prepared[leaf.path, leaf.arrays] = ChunkLayout.stored(leaf, self.checked_metadata(leaf, opened))

    @functools.cached_property
    def packed_layout(self) -> ChunkLayout:
        """The packed array's layout, its metadata (and its files) checked once for every read of it."""
        assert self.packing is not None
        return self.layout(self.packing.record)

    def chunk_reads(
        self, record: StoredLeaf, layout: ChunkLayout, region: Region | None, out: np.ndarray, done: Callable[[], None]
    ) -> Iterator[Task]:
        """Tasks that read the chunks of ``region`` (None: all; chunk-aligned) of ``record``'s
        array into ``out`` (shaped like it), checking each one's checksum, then call ``done``.
        Made as the window takes them: a read that fails stops before the rest are made."""
        box = tuple(range(n) for n in layout.shape) if region is None else tuple(range(s.start, s.stop) for s in region)
        yield from self.selection_reads(record, layout, box, out, done)

    def selection_reads(
        self, record: StoredLeaf, layout: ChunkLayout, box: Sequence[range], out: np.ndarray, done: Callable[[], None]
    ) -> Iterator[Task]:
        """Tasks that read the elements ``box`` selects (`ChunkLayout.parts`) of ``record``'s
        array into ``out`` (shaped like ``box``), each chunk once, then call ``done``."""
        files = self.files_of(record).chunk_files()
        task: Task | None = None
        for key, part, take, put in layout.parts(box):
            if task is not None:
                yield task
            into = out[(*put, ...)]  # a view, even 0-d

            async def work(key: str = key, part: Region = part, take: Region = take, into: np.ndarray = into) -> None:
                with reading(record):
                    await read_into(files, f"{record.path}/{key}", layout, part, take, into)

            task = (math.prod(s.stop - s.start for s in part) * layout.dtype.itemsize, work, None)
        last: Task = (0, lambda: None, None) if task is None else task
        yield (last[0], last[1], lambda _: done())  # the last one settles after all the others

    def scan(self, arrays: Iterable[tuple[StoredLeaf, ChunkLayout, "Settle"]], nbytes: int) -> None:
        """Read each array of ``arrays`` (a record, its checked layout, and what takes its
        bytes) a slab of rows of chunks at a time, in order, every chunk's checksum checked,
        a window of reads in flight: what `verify` checks a checkpoint with.

        ``settle(block, start, bytes, failure, last)`` gets each slab's block (0 but in a
        part), its first byte in the array (for an array stored whole), its bytes (a
        buffer reused once settled), or why its read failed: a failure is never raised, so
        every other slab is still read; ``last`` marks an array's last slab.

        **Arguments:**

        - `arrays`: what to read, made as the window reaches each (a layout that fails its
          check is then its maker's to report, and the next array still read).
        - `nbytes`: about how many bytes they hold (what sizes the window).

        **Returns:** nothing.

        ```python
        record = stored.records["model/w"]
        stored.scan([(record, stored.layout(record), lambda *slab: print(slab[1], slab[3]))], record.nbytes)
        ```
        """
        # Reads in flight: an eighth of what is scanned, at least `SLAB_BYTES` and at most the
        # host memory budget: a large checkpoint's 64 MiB chunks are checked two or more at a
        # time, and a scan holds a small part of it.
        window = max(SLAB_BYTES, min(host_memory_budget(), nbytes // 8))
        buffers = _Buffers(window)

        def tasks() -> Iterator[Task]:
            for array, layout, settle in arrays:
                slabs = layout.slabs()
                row = math.prod(layout.shape[1:]) * layout.dtype.itemsize
                for n, (block, slab) in enumerate(slabs):
                    buffer = buffers.take(tuple(s.stop - s.start for s in slab), layout.dtype)
                    failed: list[CheckpointError] = []

                    def done(
                        buffer: np.ndarray = buffer,
                        failed: list = failed,
                        block: int = block,
                        start: int = slab[0].start * row if slab else 0,
                        last: bool = n == len(slabs) - 1,
                        settle: Settle = settle,
                    ) -> None:
                        settle(block, start, buffer.reshape(-1).view(np.uint8), failed[0] if failed else None, last)
                        buffers.give(buffer)

                    yield from _tolerant(self.chunk_reads(array, layout, slab, buffer, done), failed)

        run_windowed(tasks(), window)

    def fetch(
        self, leaves: Sequence[StoredLeaf], done: Callable[[int, np.ndarray], None], reserve: Callable[[int], None]
    ) -> None:
        """Read each of ``leaves`` whole, as stored, calling ``done(i, data)`` in order: all
        their metadata at once, then their chunks straight into the final buffers within a
        `read_window`. Packed leaves are read as runs of the packed array's chunks, each once."""
        own = [i for i, leaf in enumerate(leaves) if leaf.offset is None]
        packed = [i for i, leaf in enumerate(leaves) if leaf.offset is not None]
        opens = [self.open_metadata(leaves[i]) for i in own]
        layouts = {i: ChunkLayout.stored(leaves[i], self.checked_metadata(leaves[i], o)) for i, o in zip(own, opens)}
        runs = []
        if packed:
            assert self.packing is not None  # a bad chunk names the packed array; verify names its leaves
            runs = self.packing.runs([leaves[i] for i in packed], self.packed_layout.chunk[0])
        # Reserved once the files were checked: those must hold what the manifest declares.
        reserve(sum(leaves[i].nbytes for i in own) + sum(end - start for start, end, _ in runs))

        def tasks() -> Iterator[Task]:  # buffers made as the window takes their first chunk
            for i in own:
                layout = layouts[i]
                buffer = aligned_empty(layout.shape, layout.dtype)  # aligned: the jax array adopts it
                yield from self.chunk_reads(leaves[i], layout, None, buffer, lambda i=i, b=buffer: done(i, b))
            if packed:
                assert self.packing is not None
                packing, layout = self.packing, self.packed_layout
                for start, end, members in runs:
                    indices = [packed[m] for m in members]
                    buffer = aligned_empty((end - start,), np.dtype(np.uint8))

                    def unpacked(start: int = start, buffer: np.ndarray = buffer, indices: list[int] = indices) -> None:
                        for i, data in zip(indices, packing.unpack(buffer, start, [leaves[i] for i in indices])):
                            done(i, data)

                    yield from self.chunk_reads(packing.record, layout, (slice(start, end),), buffer, unpacked)

        run_windowed(tasks(), read_window(sum(leaf.nbytes for leaf in leaves)))

    def read_box(
        self, leaf: StoredLeaf, box: Sequence[range], out: np.ndarray, layout: ChunkLayout | None = None
    ) -> None:
        """Fill ``out`` (shaped like ``box``) with the elements ``box`` (ascending ranges, one
        per dimension) takes of a leaf with its own array, each chunk read once."""
        layout = self.layout(leaf) if layout is None else layout
        assert len(box) == len(layout.shape) and out.dtype == layout.dtype, (box, layout.shape, out.dtype)
        run_windowed(self.selection_reads(leaf, layout, box, out, lambda: None), read_window(out.nbytes))

    def read_boxes(
        self, leaf: StoredLeaf, layout: ChunkLayout, pairs: Sequence[tuple[Sequence[range], np.ndarray]], window: int
    ) -> None:
        """Fill each ``(box, out)`` of ``pairs`` (``out`` C-contiguous, shaped like ``box``)
        with those elements of a leaf with its own array, reading every chunk that any box
        needs once (checksum checked) and copying its part of each box in, within ``window``
        bytes of reads in flight: the blocks of a leaf split by columns between devices,
        whose every chunk holds part of each, cost one read of the leaf."""
        files = self.files_of(leaf).chunk_files()
        wanted: dict[str, tuple[Region, list[tuple[np.ndarray, Region, Region]]]] = {}
        for box, out in pairs:
            for chunk, part, take, put in layout.parts(box):
                wanted.setdefault(chunk, (part, []))[1].append((out, take, put))

        async def work(chunk: str, part: Region, into: list[tuple[np.ndarray, Region, Region]]) -> None:
            with reading(leaf):  # chunks fill disjoint parts of a block: threads may share it
                # ``b[(*put, ...)]``: a view even of a 0-d block (``b[()]`` is a scalar, not writable).
                views = [(take, b[(*put, ...)]) for b, take, put in into]
                await read_scattered(files, f"{leaf.path}/{chunk}", layout, part, views)

        order = sorted(wanted.items(), key=lambda item: tuple(s.start for s in item[1][0]))  # C order: sequential
        itemsize = layout.dtype.itemsize
        tasks = (
            (math.prod(s.stop - s.start for s in part) * itemsize, functools.partial(work, c, part, into), None)
            for c, (part, into) in order
        )
        run_windowed(tasks, window)


def _tolerant(tasks: Iterable[Task], failed: list[CheckpointError]) -> Iterator[Task]:
    """``tasks`` (one slab's chunk reads), failing into ``failed`` instead of raising: a
    damaged array is reported, and every other one still read. Their last settlement
    still runs (it settles the slab)."""

    def guarded(work: Callable[[], Any]) -> Callable[[], Coroutine[Any, Any, CheckpointError | None]]:
        async def run() -> CheckpointError | None:
            try:
                await completed(work())
            except CheckpointError as e:
                return e
            return None

        return run

    def settled(then: Callable[[Any], None] | None) -> Callable[[Any], None]:
        def settle(failure: CheckpointError | None) -> None:
            if failure is not None:
                failed.append(failure)
            if then is not None:
                then(None)

        return settle

    return ((nbytes, guarded(work), settled(then)) for nbytes, work, then in tasks)


class _Buffers:
    """Buffers handed back once their bytes were checked, for the next reads: a fresh buffer
    costs a page fault per page (on a VM, often a fault in the host too), more than reading
    into it. Holds at most ``limit`` bytes of free buffers."""

    def __init__(self, limit: int):
        self._free: dict[int, list[np.ndarray]] = {}
        self._held, self._limit = 0, limit

    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        nbytes = math.prod(shape) * dtype.itemsize
        free = self._free.get(nbytes)
        if free:
            raw = free.pop()
            self._held -= nbytes
        else:
            raw = np.empty(nbytes, np.uint8)
        return raw.view(dtype).reshape(shape)

    def give(self, buffer: np.ndarray) -> None:
        if buffer.nbytes and self._held + buffer.nbytes <= self._limit:
            self._free.setdefault(buffer.nbytes, []).append(buffer.reshape(-1).view(np.uint8))
            self._held += buffer.nbytes


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


def unwritten_at(location: Storage) -> list[str]:
    """The files of the committed checkpoint at ``location`` that the save which made it did
    not write (`StoredArrays.unwritten`), which a deleter keeps; [] on an object store (whose
    deletions take only keys eqxckpt wrote); where the checkpoint cannot be read (its
    manifest damaged meanwhile), everything in it but the manifest: nothing is proven.

    ```python
    resolve("run/3").delete(keep=unwritten_at(resolve("run/3")))
    ```
    """
    if location.local is None:
        return []
    try:
        return StoredArrays.open(location).unwritten()
    except CheckpointError:
        try:
            return sorted(name for name in os.listdir(location.local) if name != MANIFEST_NAME)
        except OSError:
            return []  # gone


def validate_array_metadata(raw: bytes, record: StoredLeaf) -> dict[str, Any]:
    """A leaf's ``zarr.json``, checked against what eqxckpt writes for ``record``.

    Only the codec chain eqxckpt writes (raw little-endian bytes plus a crc32c
    checksum), a zero fill value, and a regular grid of chunks of at most
    `MAX_CHUNK_BYTES` and at most `ChunkLayout.max_count` of them are accepted, so a
    crafted file can neither skip the checksum, nor make a read allocate more than
    the array's own size plus one chunk, nor cut a leaf into a million chunks. Every
    read (whole, lazy selection, sharded, `verify`) goes through this one check.
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
    data_type = zarr_data_type(record.dtype)
    if doc.get("shape") != list(shape) or doc.get("data_type") != data_type:
        raise CorruptCheckpointError(
            f"Leaf {record.path!r} is corrupt: the manifest says {record.dtype}{list(shape)}"
            + (f" (stored as {data_type})" if data_type != record.dtype else "")
            + f" but its zarr.json says "
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
    if why := ChunkLayout.stored(record, {"chunk_grid": grid}).refusal():
        raise bad(why)
    if not _is_zero(doc.get("fill_value", None), data_type):
        raise bad(f"has a fill_value of {doc.get('fill_value', '(none)')!r}, not the zero eqxckpt writes")
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


def _is_zero(value: Any, dtype: str) -> bool:
    """Whether ``value`` is a zarr ``fill_value`` of zero for ``dtype``, as eqxckpt and
    TensorStore write it (``0``, ``0.0``, ``false``, ``[0.0, 0.0]``)."""

    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool) and x == 0

    if dtype == "bool":
        return value is False
    if dtype.startswith("complex"):
        return isinstance(value, list) and len(value) == 2 and all(number(x) for x in value)
    if np.dtype(dtype).kind in "iu":
        return number(value) and isinstance(value, int)
    return number(value)
