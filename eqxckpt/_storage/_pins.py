"""Reader pins: what ties a checkpoint being read to the one whose manifest was read, so
that a reader can tell whether it was replaced or deleted meanwhile (and, on a local
disk, hold it against deletion while it reads). See docs/concurrency.md ("Read").
"""

import abc
import contextlib
import os
import pathlib
from collections.abc import Iterator
from typing import Any

from .._errors import CheckpointChangedError
from .._paths import MANIFEST_NAME
from ._locks import DirLock


class Pin(abc.ABC):
    """What ties a checkpoint being read to the one whose metadata was read, and the
    guards every reader puts around its reads (`consistent`, `held`, `check_unchanged`).
    ``location`` is the checkpoint as its errors name it."""

    @abc.abstractmethod
    def changed(self) -> bool:
        """Whether the checkpoint was replaced or deleted since it was pinned."""

    @abc.abstractmethod
    def hold(self) -> "DirLock | NoLock | None":
        """A lock held while reading (None: a deleter holds it already)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Let go of what pins it."""

    @contextlib.contextmanager
    def consistent(self, location: str) -> Iterator[None]:
        """Reads inside come from the pinned checkpoint alone, or raise `CheckpointChangedError`
        (what `Source.consistent` documents)."""
        with self.held(location):
            try:
                yield
            except CheckpointChangedError:
                raise
            except Exception as e:
                if self.changed():
                    raise _changed(location) from e
                raise
            self.check_unchanged(location)

    @contextlib.contextmanager
    def held(self, location: str) -> Iterator[None]:
        """Hold the checkpoint while the block runs (`Source.held`)."""
        lock = self.hold()
        if lock is None:
            raise _changed(location)
        try:
            yield
        finally:
            lock.release()

    def check_unchanged(self, location: str) -> None:
        """Raise `CheckpointChangedError` if the checkpoint was replaced or deleted since it was pinned."""
        if self.changed():
            raise _changed(location)


def _changed(location: str) -> CheckpointChangedError:
    return CheckpointChangedError(
        f"The checkpoint at {location} was replaced or deleted by another process while it was being "
        "read, so what was read may mix two checkpoints and is discarded. Open or load it again."
    )


class LocalPin(Pin):
    """A committed local checkpoint's directory, held open since its manifest was
    read (so its identity cannot be reused), and whether its path still names it."""

    def __init__(self, path: pathlib.Path, fd: int, marker: str = MANIFEST_NAME):
        self.path = path
        self.fd = fd
        self.marker = marker  # the metadata file a deleter removes first

    def changed(self) -> bool:
        try:
            os.stat(self.marker, dir_fd=self.fd, follow_symlinks=False)
        except OSError:
            return True
        return self.moved()

    def moved(self) -> bool:
        """Whether the path no longer names the directory held open."""
        try:
            now = os.stat(self.path)
        except OSError:
            return True
        held = os.fstat(self.fd)
        return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)

    def hold(self) -> DirLock | None:
        """A shared lock for the duration of a read, so retention cannot delete it
        meanwhile; None if a deleter holds it already."""
        return DirLock.take(".", exclusive=False, dir_fd=self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class StorePin(Pin):
    """An object-store checkpoint's manifest generation (its ETag), to compare after reading."""

    def __init__(self, location: Any, generation: bytes):
        self.location = location
        self.generation = generation

    def changed(self) -> bool:
        try:
            current = (
                self.location.open_kvstore()
                .read(MANIFEST_NAME, if_not_equal=self.generation, byte_range=slice(0, 0))  # the generation alone
                .result()
            )
        except Exception:  # noqa: BLE001 - unreachable now: nothing proves it is unchanged
            return True
        # "Not modified" (unspecified) where the store honours the condition; a store that
        # ignores read conditions (Cloud Storage emulators) returns the value: then its
        # generation says whether it is the one read.
        if current.state == "unspecified":
            return False
        return current.state != "value" or current.stamp.generation != self.generation

    def hold(self) -> "NoLock":
        """Nothing to hold: a deleter on a store may remove it meanwhile, which `changed`
        then tells."""
        return NoLock()

    def close(self) -> None:
        pass


class NoLock:
    """What holding a checkpoint takes where nothing can be held."""

    def release(self) -> None:
        pass


class Unpinned(Pin):
    """A source with nothing to check (a single open file, TensorFlow's reader): it reads
    as it is."""

    def changed(self) -> bool:
        return False

    def hold(self) -> NoLock:
        return NoLock()

    def close(self) -> None:
        pass


UNPINNED = Unpinned()
