"""`open`: a read-only, lazy view of a committed checkpoint."""

import builtins
import contextlib
import difflib
import functools
import json
import math
import os
import pathlib
import stat
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from ._errors import CheckpointChangedError, CheckpointError, CorruptCheckpointError, ManifestError
from ._lease import LocalPin, StorePin
from ._manifest import LeafRecord, Manifest, read_manifest, scalar_from_json
from ._paths import depth, normalize_at, relative_to
from ._store import CHUNK_BYTES, Location, read_capped, read_spec, reason, resolve, shared_context


class Checkpoint:
    """A committed checkpoint: its leaves, their shapes and dtypes, and metadata.

    Nothing is read from the arrays until you ask for values.

    ```python
    ckpt = eqxckpt.open("ckpt/step_100")
    ckpt.paths                      # ['model/layers/0/weight', ...]
    ckpt.metadata["step"]           # 100
    w = ckpt["model/layers/0/weight"]  # LazyArray: shape and dtype, no data yet
    w.get()                         # numpy array
    ```
    """

    def __init__(self, location: Location, manifest: Manifest, pin: "LocalPin | StorePin | None" = None):
        self.location = location
        self.manifest = manifest
        self._records = {leaf.path: leaf for leaf in manifest.leaves}
        self._context = shared_context()
        self._kvstore: ts.KvStore | None = None
        self._pin = pin
        if pin is not None:
            weakref.finalize(self, pin.close)

    @contextlib.contextmanager
    def consistent(self) -> Iterator[None]:
        """Reads inside come from this checkpoint alone, or raise `CheckpointChangedError`.

        On a local disk, a shared lock keeps retention from deleting it meanwhile;
        afterwards (or when a read fails) the checkpoint must still be the one
        whose manifest was read: not replaced by a save, not being deleted.
        """
        lock = self._pin.hold() if isinstance(self._pin, LocalPin) else None
        if isinstance(self._pin, LocalPin) and lock is None:
            raise self._changed()
        try:
            try:
                yield
            except CheckpointChangedError:
                raise
            except Exception as e:
                if self._pin is not None and self._pin.changed():
                    raise self._changed() from e
                raise
            if self._pin is not None and self._pin.changed():
                raise self._changed()
        finally:
            if lock is not None:
                lock.release()

    def _changed(self) -> CheckpointChangedError:
        return CheckpointChangedError(
            f"The checkpoint at {self.location} was replaced or deleted by another process while it was being "
            "read, so what was read may mix two checkpoints and is discarded. Open or load it again."
        )

    # -- description -------------------------------------------------------------

    @property
    def paths(self) -> list[str]:
        """Every leaf path, in the order they were saved."""
        return list(self._records)

    @property
    def metadata(self) -> dict:
        """The user metadata passed to `save`."""
        return self.manifest.metadata

    @property
    def nbytes(self) -> int:
        """Total bytes of all stored arrays."""
        return sum(r.nbytes for r in self._records.values())

    def leaf(self, path: str) -> LeafRecord:
        """The manifest record of one leaf; a `KeyError` suggests near names."""
        try:
            return self._records[path]
        except KeyError:
            close = difflib.get_close_matches(path, self._records, n=3)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise KeyError(f"No leaf {path!r} in {self.location}.{hint}") from None

    def records(self, at: str | None = None) -> dict[str, LeafRecord]:
        """``{path relative to at: record}`` for the leaves under ``at``."""
        prefix = normalize_at(at)
        out = {}
        for path, record in self._records.items():
            rel = relative_to(path, prefix)
            if rel is not None:
                out[rel] = record
        return out

    def __contains__(self, path: str) -> bool:
        return path in self._records

    def __iter__(self):
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.location)!r}, {len(self)} leaves, {self.nbytes} bytes)"

    # -- values ------------------------------------------------------------------

    def __getitem__(self, path: str) -> Any:
        """A leaf (`LazyArray`, or the scalar itself) or, for a prefix, a subtree."""
        if path in self._records:
            return self.value(self._records[path])
        if self.records(path):
            return self.tree(at=path)
        self.leaf(path)  # raises a KeyError with suggestions

    def tree(self, at: str | None = None) -> Any:
        """Nested dicts/lists of `LazyArray`s and scalars, rebuilt from the manifest."""
        from ._load import build_plain_tree

        records = self.records(at)
        return build_plain_tree([(r, self.value(r)) for r in records.values()], depth(normalize_at(at)))

    def value(self, record: LeafRecord) -> Any:
        """A leaf's value as far as the manifest knows it: a `LazyArray`, a scalar, or None (opaque)."""
        if record.is_stored:
            return LazyArray(self, record)
        if record.kind == "scalar":
            return scalar_from_json(record.type_name, record.value)
        return None  # opaque: only its type is known; load() takes it from `like`

    # -- storage -----------------------------------------------------------------

    def open_array(self, record: LeafRecord) -> ts.Future:
        """Start opening a leaf's stored array: reads its ``zarr.json`` (at most
        `MAX_ZARR_JSON_BYTES`); `checked` validates it and opens the array."""
        if self.location.local is not None:
            stored_bytes(self.location.local, record)
            promise, future = ts.Promise.new()
            try:
                promise.set_result(read_capped(self.location.local / record.path / "zarr.json", MAX_ZARR_JSON_BYTES))
            except OSError as e:
                promise.set_exception(e)
            return future
        if self._kvstore is None:
            self._kvstore = self.location.open_kvstore()
        # Object stores cannot cap a read without a second request: the size is
        # checked before parsing, so memory stays bounded by the file's size.
        return self._kvstore.read(f"{record.path}/zarr.json")

    def checked(self, record: LeafRecord, opened: ts.Future) -> ts.TensorStore:
        """The opened array, after checking its ``zarr.json`` is what eqxckpt writes
        for what the manifest says.

        TensorStore then opens it from that validated metadata alone, without
        reading ``zarr.json`` again: what was checked is what is used.
        """
        with reading(record):
            result = opened.result()
        raw = result if isinstance(result, bytes) else bytes(result.value) if result.state == "value" else None
        if raw is None:
            raise corrupt(record, "its zarr.json is missing")
        metadata = validate_array_metadata(raw, record)
        with reading(record):
            return ts.open(
                read_spec(self.location.child(record.path), metadata), context=self._context, read=True
            ).result()


# Compressing filesystems (ZFS, btrfs) may allocate fewer blocks than a file's
# size for data that is genuinely there (zeros): this trusts apparent sizes.
TRUST_SPARSE = os.environ.get("EQXCKPT_TRUST_SPARSE", "") == "1"


def check_allocation(nbytes: int, what: str) -> None:
    """Refuse, before allocating, to hold more than this machine has available."""
    available = available_memory()
    if available is not None and nbytes > available:
        raise CheckpointError(
            f"{what} needs {nbytes / 2**30:.2f} GiB of host memory, but only {available / 2**30:.2f} GiB is "
            "available. Restore a part (at=, transforms=), restore onto sharded devices, or free memory."
        )


def available_memory() -> int | None:
    """Bytes the kernel says can still be allocated (MemAvailable + SwapFree), if known."""
    try:
        with builtins.open("/proc/meminfo", "rb") as f:
            fields = {line.split(b":")[0]: int(line.split()[1]) * 1024 for line in f}
    except (OSError, ValueError, IndexError):
        return None
    return fields.get(b"MemAvailable", 0) + fields.get(b"SwapFree", 0) or None


def stored_bytes(root: pathlib.Path, record: LeafRecord) -> int:
    """Check a local leaf's files before TensorStore touches them; return their size.

    A checkpoint may come from anywhere: no component of the leaf's directory
    may be a symlink (it could lead out of the checkpoint), nothing below it
    may be anything but plain files and directories, and the files must hold
    at least the bytes the manifest declares, so a crafted shape cannot make
    the reader allocate memory that no data backs.
    """
    where = root
    for part in record.path.split("/"):
        where = where / part
        try:
            mode = os.lstat(where).st_mode
        except FileNotFoundError:
            raise corrupt(record, f"{where} does not exist") from None
        if not stat.S_ISDIR(mode):
            raise _unsafe(record, where)
    total = 0
    pending = [where]
    try:
        while pending:
            with os.scandir(pending.pop()) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        pending.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        info = entry.stat(follow_symlinks=False)
                        # Blocks really allocated: a sparse file's apparent size is no data.
                        total += info.st_size if TRUST_SPARSE else min(info.st_size, info.st_blocks * 512)
                    else:
                        raise _unsafe(record, pathlib.Path(entry.path))
    except OSError as e:  # vanished while listed: deleted under us
        raise corrupt(record, f"{e.filename}: {e.strerror}") from None
    if total < record.nbytes:
        raise corrupt(
            record,
            f"the manifest declares {record.nbytes} bytes ({record.dtype}"
            f"{list(record.data_shape)}) but its files hold only {total} on disk (sparse or "
            "truncated files are refused; on a compressing filesystem set "
            "EQXCKPT_TRUST_SPARSE=1 for checkpoints you trust)",
        )
    return total


MAX_ZARR_JSON_BYTES = 64 * 1024


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


def validate_array_metadata(raw: bytes, record: LeafRecord) -> dict:
    """A leaf's ``zarr.json``, checked against what eqxckpt writes for ``record``.

    Only the codec chain eqxckpt writes (raw little-endian bytes plus a crc32c
    checksum) and a regular grid of chunks of at most `CHUNK_BYTES` are
    accepted, so a crafted file can neither skip the checksum nor make a read
    allocate more than the array's own size plus one chunk.
    """

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"Leaf {record.path!r}: its zarr.json {why}. eqxckpt never writes that: the checkpoint is damaged or "
            "crafted; do not trust it."
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
            f"{doc.get('data_type')}{doc.get('shape')}. Restore the checkpoint from a copy or load an earlier one."
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


def _unsafe(record: LeafRecord, where: pathlib.Path) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"Leaf {record.path!r}: {where} is a symlink or special file, not the plain files eqxckpt writes. "
        "Refusing to read it (it could point outside the checkpoint). Do not trust this checkpoint."
    )


@contextlib.contextmanager
def reading(record: LeafRecord):
    """Any failure while reading ``record`` becomes a `CorruptCheckpointError` naming it."""
    try:
        yield
    except CheckpointError:  # already says what is wrong
        raise
    except Exception as e:
        raise corrupt(record, e) from None


def corrupt(record: LeafRecord, error: BaseException | str) -> CorruptCheckpointError:
    """The error for a leaf whose stored data cannot be read back intact."""
    return CorruptCheckpointError(
        f"Leaf {record.path!r} is corrupt or missing on disk: {reason(error)}. Restore the checkpoint "
        "from a copy or load an earlier one; `eqxckpt inspect` still shows what it held."
    )


@functools.cache
def key_dtype(impl: str) -> Any:
    """The dtype of typed PRNG keys of ``impl`` (``key<fry>`` for threefry2x32)."""
    try:
        return jax.random.key(0, impl=impl).dtype
    except ValueError:
        raise ManifestError(f"The manifest names a PRNG implementation this JAX does not know: {impl!r}.") from None


def wrap_prng(record: LeafRecord, data: Any) -> jax.Array:
    """Typed PRNG keys are stored as key data; turn them back into keys."""
    key_dtype(record.impl)  # a clear error for an unknown implementation
    try:
        return jax.random.wrap_key_data(data, impl=record.impl)
    except (ValueError, TypeError) as e:
        raise CorruptCheckpointError(
            f"Leaf {record.path!r}: its stored key data {data.shape} does not fit PRNG implementation "
            f"{record.impl!r} ({e}). The checkpoint is damaged or was edited."
        ) from None


class LazyArray:
    """One stored array: ``shape``, ``dtype`` and ``nbytes`` now, data on ``get()``.

    Indexing (``lazy[0, :4]``) and ``astype`` are deferred too, so only the
    selected elements are ever read.

    ```python
    w = eqxckpt.open("ckpt")["model/layers/0/weight"]
    w.shape, w.dtype          # no I/O beyond the manifest
    w[:2].astype("float32").get()
    ```
    """

    def __init__(self, checkpoint: Checkpoint, record: LeafRecord, index: Any = (), dtype: Any = None):
        self.checkpoint = checkpoint
        self.record = record
        self._index = index
        self._dtype = None if dtype is None else np.dtype(dtype)

    @property
    def path(self) -> str:
        return self.record.path

    @property
    def shape(self) -> tuple[int, ...]:
        shape = self.record.shape
        if self._index == ():
            return shape
        return np.broadcast_to(np.empty((), np.int8), shape)[self._index].shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> np.dtype:
        if self._dtype is not None:
            return self._dtype
        return key_dtype(self.record.impl) if self.record.kind == "prng_key" else np.dtype(self.record.dtype)

    @property
    def nbytes(self) -> int:
        if self.record.kind == "prng_key":
            return int(np.prod(self.shape + self.record.key_shape)) * np.dtype(self.record.dtype).itemsize
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def __getitem__(self, index: Any) -> "LazyArray":
        if self._index != ():
            raise NotImplementedError("Index a LazyArray once; combine the indices into one expression.")
        if self.record.kind == "prng_key":
            raise NotImplementedError("Slicing lazy PRNG key arrays is not supported; get() the whole array.")
        return LazyArray(self.checkpoint, self.record, index, self._dtype)

    def astype(self, dtype: Any) -> "LazyArray":
        """A lazy cast: the conversion happens on ``get()``."""
        return LazyArray(self.checkpoint, self.record, self._index, dtype)

    def _view(self) -> ts.TensorStore:
        store = self.checkpoint.checked(self.record, self.checkpoint.open_array(self.record))
        return store[self._index] if self._index != () else store

    def source(self) -> ts.TensorStore:
        """The stored array as a TensorStore view (indexed and cast as this
        LazyArray is), to copy from without reading it all into memory."""
        view = self._view()
        return view if self._dtype is None else ts.cast(view, self._dtype)

    def _start(self) -> ts.Future:
        view = self._view()
        check_allocation(self.nbytes, f"Reading leaf {self.path!r}")
        return view.read()

    def _finish(self, data: np.ndarray) -> Any:
        if self.record.kind == "prng_key":
            return wrap_prng(self.record, data)
        if self._dtype is not None:
            data = data.astype(self._dtype)
        return data

    def get(self) -> Any:
        """Read the data (a numpy array; a jax key array for PRNG keys)."""
        with self.checkpoint.consistent(), reading(self.record):
            data = self._start().result()
        return self._finish(data)

    async def get_async(self) -> Any:
        """``await lazy.get_async()``: read without blocking the event loop."""
        with self.checkpoint.consistent(), reading(self.record):
            data = await self._start()
        return self._finish(data)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        data = np.asarray(self.get())
        return data if dtype is None else data.astype(dtype)

    def __repr__(self) -> str:
        return f"LazyArray({self.path!r}, shape={self.shape}, dtype={self.dtype})"


def open(path: Any) -> Checkpoint:  # noqa: A001 - public name fixed by the design
    """Open a committed checkpoint read-only, without reading any array.

    ```python
    ckpt = eqxckpt.open("ckpt/step_100")
    print(ckpt.paths, ckpt.metadata)
    ```
    """
    location = resolve(path)
    manifest, pin = read_manifest(location)
    return Checkpoint(location, manifest, pin)
