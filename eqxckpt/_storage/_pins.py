"""Reader pins: what ties a checkpoint being read to the one whose manifest was read, so
that a reader can tell whether it was replaced or deleted meanwhile (and, on a local
disk, hold it against deletion while it reads). See docs/concurrency.md ("Read").
"""

import os
import pathlib
from typing import Any

from .._paths import MANIFEST_NAME
from ._locks import DirLock


class LocalPin:
    """A committed local checkpoint's directory, held open since its manifest was
    read (so its identity cannot be reused), and whether its path still names it."""

    def __init__(self, path: pathlib.Path, fd: int, marker: str = MANIFEST_NAME):
        self.path = path
        self.fd = fd
        self.marker = marker  # the metadata file a deleter removes first

    def changed(self) -> bool:
        try:
            now = os.stat(self.path)
            os.stat(self.marker, dir_fd=self.fd, follow_symlinks=False)
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


class StorePin:
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


# What pins a checkpoint being read to the one opened.
Pin = LocalPin | StorePin
