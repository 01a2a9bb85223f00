"""safetensors files (one, or a sharded HuggingFace directory) as a read-only `Source`.

A file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range in the data that follows, then the data.
The header is validated as strictly as a manifest (size cap, offsets inside
the data, sizes that match the shapes, no overlaps) before anything is read,
and each tensor is read lazily, with one ranged read of exactly its bytes.

Tensor names map to paths by splitting at ``.``:
``encoder.block.0.layer.0.SelfAttention.q.weight`` is
``encoder/block/0/layer/0/SelfAttention/q/weight``.
"""

import math
import os
import pathlib
import stat
import struct
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..._errors import CheckpointNotFoundError, CorruptCheckpointError, ManifestError
from ..._leaf import UNKNOWN, ArrayLeaf, KeyRecord, StoredLeaf, parse_shape
from ..._manifest import MAX_PARSE_FACTOR, parse_json_object
from ..._paths import check_one_tree, encode_segment
from ..._read._source import Boxes, Source
from ..._storage import read_capped
from ..._window import Task, check_allocation, read_window, run_windowed
from .._convert import aligned_empty
from ._layout import (
    DTYPES,
    INDEX_NAME,
    LOAD_BYTES_PER_TENSOR,
    MAX_HEADER_BYTES,
    MAX_INDEX_BYTES,
    SINGLE_NAME,
    SUB_BYTE,
)


def name_to_keys(name: str) -> tuple[str, tuple[KeyRecord, ...]]:
    """A tensor name's path and key records: one dict key per ``.``-separated part."""
    parts = name.split(".")
    return "/".join(encode_segment(part) for part in parts), tuple(("dict", part) for part in parts)


class SafetensorsCheckpoint(Source):
    """One safetensors file, or a sharded HuggingFace directory, as a read-only source.

    Its `metadata` is the file's ``__metadata__`` (for a sharded directory, the
    index's ``metadata``); every tensor is read lazily, on its own. Each file is
    opened once, when its header is read, and every tensor is read from that
    open file: a file replaced meanwhile (``save_safetensors(overwrite=True)``)
    is still read whole from the version whose header was validated, never mixed.
    """

    arrays_only = True

    def __init__(self, location: str, files: dict[str, pathlib.Path], index: dict[str, str] | None = None):
        self.location = location
        self.metadata: dict[str, Any] = {}
        self._leaves = {}
        self._where: dict[str, tuple[int, int]] = {}  # path -> (open file, absolute offset)
        self._fds: list[int] = []
        weakref.finalize(self, _close_all, self._fds)
        self._names: dict[str, str] = {}  # path -> tensor name
        names = self._names
        for shard, file in files.items():
            fd = open_file(file)
            self._fds.append(fd)
            header, data_start, file_metadata = read_header(fd, file)
            if index is None:
                self.metadata = dict(file_metadata)
            for name, (leaf_dtype, shape, begin) in header.items():
                if index is not None and index.get(name) != shard:
                    raise ManifestError(
                        f"{file} holds tensor {name!r}, but {INDEX_NAME} puts it in {index.get(name)!r}. "
                        "The directory is inconsistent; re-save it."
                    )
                path, keys = name_to_keys(name)
                if path in names:
                    raise ManifestError(f"Tensors {names[path]!r} and {name!r} both map to path {path!r}.")
                names[path] = name
                self._leaves[path] = ArrayLeaf(path, keys, shape, leaf_dtype, UNKNOWN)
                self._where[path] = (fd, data_start + begin)
        if index is not None:
            missing = sorted(set(index) - set(names.values()))
            if missing:
                raise ManifestError(
                    f"{INDEX_NAME} of {location} lists {len(missing)} tensors its shards do not hold "
                    f"(e.g. {missing[0]!r}). The directory is incomplete."
                )
        check_one_tree(self._leaves, location, lambda path: names[path])

    def origin(self, leaf_path: str) -> str:
        self.leaf(leaf_path)
        return self._names[leaf_path]

    def _fetch(
        self, leaves: Sequence[StoredLeaf], done: Callable[[int, np.ndarray], None], reserve: Callable[[int], None]
    ) -> None:
        # Each tensor with one ranged read straight into the buffer it is restored in,
        # on the I/O threads (a fresh process's page faults are spread over the cores).
        reserve(sum(leaf.nbytes for leaf in leaves))
        tasks: list[Task] = []
        for i, leaf in enumerate(leaves):
            fd, offset = self._where[leaf.path]
            buffer = aligned_empty(leaf.data_shape, np.dtype(leaf.dtype))
            read = lambda fd=fd, offset=offset, buffer=buffer, path=leaf.path: read_range(fd, offset, buffer, path)  # noqa: E731
            tasks.append((buffer.nbytes, read, lambda _, i=i, buffer=buffer: done(i, buffer)))
        run_windowed(tasks, read_window(sum(leaf.nbytes for leaf in leaves)))

    def chunk_shapes(self, leaves: Sequence[StoredLeaf]) -> list[tuple[int, ...] | None]:
        """A row: a tensor is stored in C order, its rows read by one ranged read each run."""
        return [(1, *leaf.shape[1:]) if leaf.shape else None for leaf in leaves]

    def _read_boxes(self, leaf: StoredLeaf, boxes: Boxes, window: int) -> None:
        """Runs of whole rows, each with one ranged read (`read_by_rows`)."""
        fd, offset = self._where[leaf.path]
        row_bytes = leaf.nbytes // max(1, leaf.shape[0])

        def read_rows(start: int, stop: int, out: np.ndarray) -> None:
            read_range(fd, offset + start * row_bytes, out, leaf.path)

        read_by_rows(leaf, boxes, window, read_rows)


def read_by_rows(
    leaf: StoredLeaf, boxes: Boxes, window: int, read_rows: Callable[[int, int, np.ndarray], None]
) -> None:
    """`Source._read_boxes` of a tensor read as runs of whole rows (``read_rows(start, stop,
    out)``): a box of whole rows straight into its buffer; the others a window of rows at a
    time (at least one row, its memory checked), copied out, so each row is read once."""
    shape, dtype = leaf.data_shape, np.dtype(leaf.dtype)
    boxes = [(box, out) for box, out in boxes if out.size]
    whole = lambda box: box[0].step == 1 and all(r == range(n) for r, n in zip(box[1:], shape[1:]))  # noqa: E731
    if all(whole(box) for box, _ in boxes):
        for box, out in boxes:
            read_rows(box[0].start, box[0].stop, out)
        return
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    start, stop = min(box[0][0] for box, _ in boxes), max(box[0][-1] + 1 for box, _ in boxes)
    step = max(1, window // max(1, row_bytes))
    for a in range(start, stop, step):
        b = min(stop, a + step)
        check_allocation((b - a) * row_bytes, f"Reading leaf {leaf.path!r}")
        rows = aligned_empty((b - a, *shape[1:]), dtype)
        read_rows(a, b, rows)
        for box, out in boxes:
            wanted = box[0]  # the box's rows within [a, b): a run of its own indices
            first = max(0, -(-(a - wanted.start) // wanted.step))
            last = min(len(wanted), max(0, -(-(b - wanted.start) // wanted.step)))
            if first < last:
                taken = wanted[first:last]
                rest = tuple(slice(r.start, r.stop, r.step) for r in box[1:])
                out[first:last] = rows[(slice(taken.start - a, taken.stop - a, taken.step), *rest)]


def read_range(fd: int, offset: int, buffer: np.ndarray, path: str) -> None:
    """Fill ``buffer`` with the bytes of the open file ``fd`` from ``offset`` (one ranged read)."""
    view = buffer.reshape(-1).view(np.uint8).data
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise CorruptCheckpointError(
                f"Leaf {path!r}: its file ended before the tensor's bytes (it was truncated in place).", leaf_path=path
            )
        done += n


def open_file(file: pathlib.Path) -> int:
    """``file`` opened for reading; a symlink or anything but a regular file is refused
    (opened without blocking, so a FIFO in its place cannot hang the reader)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise CheckpointNotFoundError(f"Cannot open {file}: {e.strerror} (symlinks are refused).") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ManifestError(f"{file} is not a regular file (a FIFO, device or directory); refusing to read it.")
    os.set_blocking(fd, True)
    return fd


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def read_header(fd: int, file: pathlib.Path) -> tuple[dict[str, tuple[str, tuple[int, ...], int]], int, dict[str, str]]:
    """The tensors ``{name: (dtype, shape, begin)}`` of the safetensors file open as ``fd``,
    where its data starts, and its ``__metadata__``; `ManifestError` for anything off."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise ManifestError(f"{file} is too short to be a safetensors file ({size} bytes).")
    (length,) = struct.unpack("<Q", head)
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise ManifestError(
            f"{file}: its header claims {length} bytes (the file has {size}; at most {MAX_HEADER_BYTES} are "
            "accepted). It is not a safetensors file, or it is damaged or crafted."
        )
    raw = os.pread(fd, length, 8)
    data_size = size - 8 - length
    tensors_declared = raw.count(b"data_offsets")  # counted before parsing: an upper bound
    if tensors_declared * LOAD_BYTES_PER_TENSOR > MAX_PARSE_FACTOR * length + (16 << 20):
        raise ManifestError(
            f"{file}: its {length}-byte header declares up to {tensors_declared} tensors; opening and loading "
            f"them would take about {tensors_declared * LOAD_BYTES_PER_TENSOR >> 20} MiB, over {MAX_PARSE_FACTOR} "
            "times the header (real files spend about 100 bytes of header on each tensor). It is crafted, or "
            "splits its data into too many tiny tensors: refusing to read it."
        )
    doc = parse_json_object(raw, f"The header of {file}", MAX_HEADER_BYTES)
    metadata = doc.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ManifestError(f"{file}: its __metadata__ must map strings to strings.")
    tensors: dict[str, tuple[str, tuple[int, ...], int]] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in doc.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise ManifestError(f"{file}: tensor {name!r} is not {{dtype, shape, data_offsets}}.")
        dtype = DTYPES.get(entry["dtype"]) if isinstance(entry["dtype"], str) else None
        if dtype is None and entry["dtype"] in SUB_BYTE:
            raise ManifestError(
                f"{file}: tensor {name!r} is {entry['dtype']}, {SUB_BYTE[entry['dtype']]} packed several to a byte, "
                "which eqxckpt does not read. Unpack it to one element a byte (or U8) with the tool that wrote it."
            )
        if dtype is None:
            raise ManifestError(f"{file}: tensor {name!r} has an unknown dtype {entry['dtype']!r}.")
        shape = parse_shape(entry["shape"], name)
        offsets = entry["data_offsets"]
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_size
        ):
            raise ManifestError(
                f"{file}: tensor {name!r} has data_offsets {offsets!r} outside the {data_size} bytes of data. "
                "The file is truncated, damaged or crafted."
            )
        if offsets[1] - offsets[0] != math.prod(shape) * np.dtype(dtype).itemsize:
            raise ManifestError(
                f"{file}: tensor {name!r} is {entry['dtype']}{list(shape)} but spans {offsets[1] - offsets[0]} bytes."
            )
        tensors[name] = (dtype, shape, offsets[0])
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise ManifestError(
                f"{file}: tensors {first!r} and {second!r} overlap in the data. The file is damaged or crafted."
            )
    return tensors, 8 + length, metadata


def open_safetensors(path: pathlib.Path) -> SafetensorsCheckpoint:
    """A ``.safetensors`` file, a directory holding ``model.safetensors``, or a sharded
    directory (``model.safetensors.index.json`` and its shards)."""
    if path.is_file():
        return SafetensorsCheckpoint(str(path), {path.name: path})
    index_file = path / INDEX_NAME
    if index_file.is_file() or index_file.is_symlink():
        try:
            raw = read_capped(index_file, MAX_INDEX_BYTES)
        except OSError as e:
            raise ManifestError(
                f"Cannot read {index_file}: {e.strerror or e} (a symlink or special file in its place is refused)."
            ) from None
        doc = parse_json_object(raw, str(index_file), MAX_INDEX_BYTES)
        weight_map = doc.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ManifestError(f"{index_file} has no 'weight_map' of tensor names to shard files.")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if "/" in shard or "\\" in shard or shard.startswith(".") or not shard:
                raise ManifestError(f"{index_file} names shard {shard!r}, which is not a file in {path}.")
        source = SafetensorsCheckpoint(str(path), {shard: path / shard for shard in shards}, weight_map)
        metadata = doc.get("metadata", {})
        source.metadata = dict(metadata) if isinstance(metadata, dict) else {}
        return source
    if (path / SINGLE_NAME).is_file():
        return SafetensorsCheckpoint(str(path), {SINGLE_NAME: path / SINGLE_NAME})
    raise CheckpointNotFoundError(f"No safetensors file at {path} (no {SINGLE_NAME} or {INDEX_NAME}).")
