"""Chunk files on a local disk (`LocalChunkFiles`): each chunk's file written with one
``writev`` and read with ``preadv`` straight into the reader's buffers, opened without
following a symlink."""

import os
import stat
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from .._chunks import ChunkFileError, ChunkFiles
from ._fs import start_writeback
from ._stamps import settled


class LocalChunkFiles(ChunkFiles):
    """Chunk files as plain files, written with ``writev`` and read with ``preadv``
    straight from and into the arrays' buffers: no copy in between, where TensorStore's
    file kvstore hands back a copy of every file."""

    def __init__(
        self,
        root: str,
        generations_read: "dict[str, set[str]] | None" = None,
        generation: Callable[[os.stat_result], str | None] | None = None,
    ):
        self._root = root
        # See `Storage.recording_generations`: here the stamp (`_stamps`) of each file read,
        # taken before and after its reads (a file written meanwhile records two, one
        # modified just before it was read one more: nothing is vouched for by either).
        self._generations_read = generations_read
        self._generation = generation

    def write(self, key: str, pieces: Sequence[np.ndarray]) -> None:
        path = f"{self._root}/{key}"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
        try:
            buffers = [piece.data.cast("B") for piece in pieces]
            while buffers:  # a packed chunk's leaves may be more buffers than one writev takes
                buffers = _past(buffers, os.writev(fd, buffers[:_IOV_MAX]))
            start_writeback(fd)
        finally:
            os.close(fd)

    def read(self, key: str, into: Sequence[np.ndarray], at: int = 0, size: int | None = None) -> None:
        wanted = sum(buffer.nbytes for buffer in into)
        self._read_ranges(key, iter([(at, into)]), at + wanted if size is None else size)

    async def reading_ranges(self, key: str, ranges: Iterator[tuple[int, Sequence[np.ndarray]]], size: int) -> None:
        self._read_ranges(key, ranges, size)

    def _read_ranges(self, key: str, ranges: Iterator[tuple[int, Sequence[np.ndarray]]], size: int) -> None:
        """Each range of one open file: another file renamed over it meanwhile is never read."""
        try:
            # Never through a symlink (it could lead out of the checkpoint), and never blocked
            # opening a FIFO put in a chunk's place: only a regular file is read.
            fd = os.open(f"{self._root}/{key}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            raise ChunkFileError(f"chunk file {key} is missing") from None
        except OSError as e:
            raise ChunkFileError(f"chunk file {key} cannot be read ({e.strerror})") from None
        try:
            found = os.fstat(fd)
            if not stat.S_ISREG(found.st_mode):
                raise ChunkFileError(f"chunk file {key} is not a regular file")
            if found.st_size != size:
                raise ChunkFileError(f"chunk file {key} holds {found.st_size} bytes, not {size}")
            for at, into in ranges:
                buffers = [buffer.data.cast("B") for buffer in into]
                offset = at
                while buffers:
                    got = os.preadv(fd, buffers[:_IOV_MAX], offset)
                    if got == 0:
                        raise ChunkFileError(f"chunk file {key} was cut short while it was read")
                    offset += got
                    buffers = _past(buffers, got)
            if self._generations_read is not None and self._generation is not None:
                read = self._generations_read.setdefault(key, set())
                read.update(str(self._generation(info)) for info in (found, os.fstat(fd)))
                if not settled(found):  # a write begun just before may still be landing
                    read.add("unsettled")
        finally:
            os.close(fd)


_IOV_MAX = 1024  # buffers one preadv may take (Linux)


def _past(buffers: list[memoryview], done: int) -> list[memoryview]:
    """What is left of ``buffers`` once the first ``done`` bytes were moved (a short
    ``writev`` or ``preadv``). One copy of the list per call: a chunk read straight into
    several devices' blocks may have thousands of buffers."""
    k = 0
    while k < len(buffers) and done >= len(buffers[k]):
        done -= len(buffers[k])
        k += 1
    rest = buffers[k:]
    if rest:
        rest[0] = rest[0][done:]
    return rest
