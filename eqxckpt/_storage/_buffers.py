"""`BufferStorage`: a committed checkpoint whose files are byte buffers of this process
(the copy of a part a peer sent), read in place: nothing is written anywhere first."""

import bisect
import dataclasses
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from .._chunks import ChunkFileError, ChunkFiles
from .._errors import CheckpointError, CheckpointNotFoundError, ManifestError
from .._leaf import StoredLeaf
from .._manifest import MAX_MANIFEST_BYTES, Manifest, parse_manifest
from .._paths import MANIFEST_NAME, validate_path
from ._backend import MAX_ZARR_JSON_BYTES, Staging, Storage, corrupt
from ._pins import UNPINNED, Pin


class _Files:
    """The files, by key, with their keys sorted: a directory's total size by bisection."""

    def __init__(self, files: Mapping[str, np.ndarray]):
        self.files = dict(files)
        self.keys = sorted(self.files)
        sizes = np.array([self.files[key].nbytes for key in self.keys], np.int64)
        self.totals = np.concatenate([[0], np.cumsum(sizes)])

    def size_under(self, prefix: str) -> int:
        """The bytes of every file whose key starts with ``prefix``."""
        start = bisect.bisect_left(self.keys, prefix)
        stop = bisect.bisect_left(self.keys, prefix + "\U0010ffff")
        return int(self.totals[stop] - self.totals[start])


@dataclasses.dataclass(frozen=True)
class BufferStorage(Storage):
    """A checkpoint held as its files' bytes in this process, read only: a peer's copy of a
    local-tier part restored as it arrived (`LocalTier.received`). Its manifest is checked
    as any other's; a leaf's files must hold the bytes its manifest declares before any is
    allocated; a chunk of the wrong size or checksum is damage, as on a disk.

    **Arguments:**

    - `files`: ``{key: bytes}`` (uint8 arrays), keys relative to the checkpoint, its
      manifest among them.
    - `name`: what errors call it.

    ```python
    load(BufferStorage.of(dict(files), "process 2's part of step 8"), like)
    ```
    """

    held: _Files | None = dataclasses.field(default=None, compare=False)
    prefix: str = ""
    name: str = ""

    @classmethod
    def of(cls, files: Mapping[str, np.ndarray], name: str) -> "BufferStorage":
        return cls({"driver": "memory", "path": f"eqxckpt-buffers/{uuid.uuid4().hex}/"}, _Files(files), "", name)

    @property
    def _files(self) -> _Files:
        assert self.held is not None
        return self.held

    def sub(self, name: str) -> "BufferStorage":
        return dataclasses.replace(self, kvstore=self.child(name), prefix=f"{self.prefix}{validate_path(name)}/")

    def user_path(self) -> dict[str, Any]:
        return dict(self.kvstore)

    def __str__(self) -> str:
        return f"{self.name}/{self.prefix}".rstrip("/")

    def chunk_files(self) -> ChunkFiles:
        return _BufferChunkFiles(self._files, self.prefix)

    def _bytes(self, key: str) -> np.ndarray | None:
        return self._files.files.get(f"{self.prefix}{key}")

    def read_manifest(self) -> tuple[Manifest, Pin]:
        raw = self._bytes(MANIFEST_NAME)
        if raw is None:
            raise CheckpointNotFoundError(f"No checkpoint in {self}: it holds no {MANIFEST_NAME}.")
        if raw.nbytes > MAX_MANIFEST_BYTES:  # as `parse_manifest` says it, without a copy of it first
            raise ManifestError(
                f"The manifest of {self} is {raw.nbytes} bytes, over the {MAX_MANIFEST_BYTES}-byte limit."
            )
        return parse_manifest(raw.tobytes(), str(self)), UNPINNED

    def read_leaf_metadata(self, leaf: StoredLeaf) -> ts.Future:
        promise, future = ts.Promise.new()
        try:
            held = self._files.size_under(f"{self.prefix}{leaf.path}/")
            if held < leaf.nbytes:
                raise corrupt(leaf, f"the manifest declares {leaf.nbytes} bytes but its files hold only {held}")
            raw = self._bytes(f"{leaf.path}/zarr.json")
            if raw is not None and raw.nbytes > MAX_ZARR_JSON_BYTES:
                raise corrupt(leaf, f"its zarr.json holds {raw.nbytes} bytes, over {MAX_ZARR_JSON_BYTES}")
            promise.set_result(None if raw is None else raw.tobytes())
        except BaseException as e:  # raised by whoever waits for the future
            promise.set_exception(e)
        return future

    def _read_only(self) -> CheckpointError:
        return CheckpointError(f"{self} is a copy held in memory, read only: it cannot be saved to or changed.")

    def begin_save(self, paths: list[str], overwrite: bool) -> Staging:
        raise self._read_only()

    def join_save(self, where: str) -> Staging:
        raise self._read_only()

    def list_entries(self) -> list[tuple[str, str]]:
        return []

    def clean_leftovers(self, entries: Callable[[str], bool]) -> list[str]:
        return []

    def delete(self, keep: Sequence[str] = ()) -> bool:
        raise self._read_only()

    def read_small(self, name: str, cap: int) -> bytes | None:
        raw = self._bytes(name)
        return None if raw is None else raw[: cap + 1].tobytes()

    def create_once(self, name: str, raw: bytes) -> bool:
        raise self._read_only()


class _BufferChunkFiles(ChunkFiles):
    """Chunk files read from the buffers: one copy, into the reader's buffers."""

    def __init__(self, files: _Files, prefix: str):
        self._files, self._prefix = files, prefix

    def write(self, key: str, pieces: Sequence[np.ndarray]) -> None:
        raise ChunkFileError(f"chunk file {key} cannot be written: the checkpoint is a read-only copy in memory")

    def read(self, key: str, into: Sequence[np.ndarray], at: int = 0, size: int | None = None) -> None:
        data = self._files.files.get(f"{self._prefix}{key}")
        if data is None:
            raise ChunkFileError(f"chunk file {key} is missing")
        size = at + sum(buffer.nbytes for buffer in into) if size is None else size
        if data.nbytes != size:
            raise ChunkFileError(f"chunk file {key} holds {data.nbytes} bytes, not {size}")
        source = data.data.cast("B")
        offset = at
        for buffer in into:
            target = buffer.data.cast("B")
            target[:] = source[offset : offset + target.nbytes]
            offset += target.nbytes
