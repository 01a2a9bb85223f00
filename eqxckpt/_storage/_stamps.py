"""Stamps of local files, and a run directory's book of those eqxckpt's own links gave.

A file's stamp is its device, inode, size, and modification and change times in
nanoseconds: a write, a truncation, a file renamed over it or put in its place changes
one of them, and so does setting the modification time back (it sets the change time).
A local leaf checked whole records its files' stamps (`Seen`), and a later incremental
save shares it without reading it while the stamps are those (`_write/_reuse`).

eqxckpt's own hard links and unlinks change a shared file's change time but not its
bytes: a save links the files it shares, and deleting a step unlinks them, every step.
The run directory's stamp book (`BOOK_NAME`) records, for each file whose names eqxckpt
linked or unlinked, the stamp that followed and what the file's stamp stood for before
(its generation): a file only linked since it was checked still reports the generation it
was checked at, one written since reports its own new stamp.

The book is a cache: a book that is missing, damaged or over its size is read as empty,
and everything is then read and checked again. docs/threat-model.md says what this trusts.
"""

import contextlib
import fcntl
import json
import os
import pathlib
import stat
import struct
import time
from collections.abc import Iterator, Sequence

from crc32c import crc32c

from ._locks import flock_within, remove_abandoned_files, write_file

BOOK_NAME = ".eqxckpt-stamps"
# Entries not renewed for this long serve no save (their `Seen` is older than any full
# check interval a run keeps), nor past this many: the oldest go first.
BOOK_ENTRY_DAYS = 7.0
MAX_BOOK_ENTRIES = 1 << 16
MAX_BOOK_BYTES = 16 << 20
# How long a save waits for another's hold on the book before it reads its files instead:
# the book is a cache, and whoever can open it (read access is enough) can hold its lock.
BOOK_LOCK_WAIT_S = 1.0
# A write sets a file's times when it begins, not when its bytes land: a check that reads a
# file modified less than this long before records no stamp to vouch by (a write may still
# be copying bytes it did not see), and the next save checks it again.
SETTLE_S = 5.0


def settled(info: os.stat_result) -> bool:
    """Whether the file ``info`` describes was last modified at least `SETTLE_S` ago."""
    return time.time_ns() - info.st_mtime_ns >= SETTLE_S * 1e9


def stamp_of(info: os.stat_result) -> str:
    """A file's stamp (device, inode, size, modification and change times in ns), as hex.

    ```python
    stamp_of(os.lstat(path))  # '0000000000000803000000000012d3e1...'
    ```
    """
    return struct.pack(">QQQqq", info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns).hex()


def _inode(stamp: str) -> str:
    return stamp[:32]  # its device and inode: the file, whatever its bytes


class StampBook:
    """The stamp book of a run directory: ``{inode: (stamp, generation, unix)}``, what
    eqxckpt's own links and unlinks made a file's stamp, and the generation it stood for.

    **Arguments:**

    - `directory`: the run directory (the parent of its checkpoints).

    ```python
    book = StampBook(pathlib.Path("run"))
    book.generations([os.lstat("run/3/w/c/0")])  # the stamp it was checked at
    ```
    """

    def __init__(self, directory: pathlib.Path):
        self.path = directory / BOOK_NAME
        self._entries: dict[str, tuple[str, str, float]] | None = None

    def exists(self) -> bool:
        return os.path.lexists(self.path)

    def generations(self, infos: Sequence[os.stat_result | None]) -> list[str | None]:
        """The generation of each file as ``os.lstat`` found it (None: none to tell): its
        stamp, or what the book says a stamp eqxckpt's links made stands for."""
        if self._entries is None:
            with self._opened(fcntl.LOCK_SH, create=False) as fd:
                self._entries = {} if fd is None else _read_once(fd, self.path)
        return [None if info is None else _resolve(self._entries, stamp_of(info)) for info in infos]

    def record(self, changes: Sequence[tuple[os.stat_result, os.stat_result]]) -> None:
        """Record that eqxckpt changed each file's stamp from the first to the second of a
        pair by linking (one more name) or unlinking (one fewer) a name of it, nothing
        else: the second stands for what the first did. A pair whose size or modification
        time differ, or whose count of names moved otherwise, is not recorded: a write
        landed between the two (the file is then read and checked again). Taken under the
        book's lock; a book that cannot be written is left as it is."""
        kept = [
            (stamp_of(a), stamp_of(b))
            for a, b in changes
            if (a.st_dev, a.st_ino, a.st_size, a.st_mtime_ns) == (b.st_dev, b.st_ino, b.st_size, b.st_mtime_ns)
            and abs(b.st_nlink - a.st_nlink) == 1
        ]
        if not kept:
            return
        try:
            with self._opened(fcntl.LOCK_EX, create=True) as fd:
                if fd is None:
                    return  # held by another past the wait: its files are read again
                entries = _read(fd)
                now = time.time()
                for before, after in kept:
                    entries[_inode(after)] = (after, _resolve(entries, before), now)
                self._write(fd, _pruned(entries, now))
                self._entries = None
            remove_abandoned_files(self.path)  # what a save killed replacing it left
        except OSError:
            pass

    def _write(self, fd: int, entries: list[tuple[str, str, float]]) -> None:
        body = json.dumps({"stamps": entries}, separators=(",", ":")).encode()
        raw = b"%08x\n" % crc32c(body) + body
        if os.fstat(fd).st_nlink == 1:
            os.pwrite(fd, raw, 0)
            os.ftruncate(fd, len(raw))
        else:
            # Its other names are outside this run (a snapshot made with hard links): never
            # rewritten in place, the run gets a book of its own.
            write_file(self.path, lambda f: f.write(raw), overwrite=True)

    @contextlib.contextmanager
    def _opened(self, lock: int, create: bool) -> Iterator[int | None]:
        """The book open and locked; None where there is none to use: missing, a symlink,
        not a regular file (reading), or held by another for `BOOK_LOCK_WAIT_S`. Where the
        filesystem has no locks, it is used unlocked (its checksum tells a torn read).
        Writing, a book that is not a regular file, or cannot be made, raises `OSError`."""
        flags = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_RDWR | os.O_CREAT if create else os.O_RDONLY)
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError:
            if create:
                raise
            yield None
            return
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                if create:
                    raise OSError(f"{self.path} is not a regular file")
                yield None
                return
            if not _locked(fd, lock, self.path):
                yield None
                return
            if create and not _names(fd, self.path):
                raise OSError(f"{self.path} was replaced while its lock was waited for")
            yield fd
        finally:
            os.close(fd)


def _names(fd: int, path: pathlib.Path) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (another save may have put a
    new book in its place meanwhile: the old one is not the run's any more)."""
    try:
        found, held = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)


# Books another process held past the wait, and until when this process does not wait
# for them again: a save asks its run's book once per leaf it checks.
_BUSY: dict[pathlib.Path, float] = {}
BOOK_BUSY_S = 60.0


def _locked(fd: int, lock: int, path: pathlib.Path) -> bool:
    """Take ``lock`` on ``fd`` (the book at ``path``) within `BOOK_LOCK_WAIT_S`: True once
    held, or where the filesystem has no locks; False if another holds it all that time
    (then, for `BOOK_BUSY_S`, without waiting)."""
    wait = 0.0 if _BUSY.get(path, 0.0) > time.monotonic() else BOOK_LOCK_WAIT_S
    if flock_within(fd, lock, wait):
        _BUSY.pop(path, None)
        return True
    _BUSY[path] = time.monotonic() + BOOK_BUSY_S
    return False


def _resolve(entries: dict[str, tuple[str, str, float]], stamp: str) -> str:
    entry = entries.get(_inode(stamp))
    return entry[1] if entry is not None and entry[0] == stamp else stamp


# The books this process parsed last, by path, with the book's own stamp then: a save asks
# its run's book once per leaf it checks, and parses it once. A book written since has
# another stamp; one kept stale (a rewrite within a clock tick) only maps stamps that did
# stand for those generations, so it can miss a mapping, never make a wrong one.
_PARSED: dict[pathlib.Path, tuple[str, dict[str, tuple[str, str, float]]]] = {}


def _read_once(fd: int, path: pathlib.Path) -> dict[str, tuple[str, str, float]]:
    """`_read`, remembered while the book's stamp stays the same."""
    stamp = stamp_of(os.fstat(fd))
    cached = _PARSED.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1]
    entries = _read(fd)
    if len(_PARSED) >= 8:
        _PARSED.pop(next(iter(_PARSED)))
    _PARSED[path] = (stamp, entries)
    return entries


def _read(fd: int) -> dict[str, tuple[str, str, float]]:
    """The book's entries; none where it is empty, damaged or not one (it is a cache)."""
    size = os.fstat(fd).st_size
    if not 0 < size <= MAX_BOOK_BYTES:
        return {}
    raw = os.pread(fd, size, 0)
    head, _, body = raw.partition(b"\n")
    try:
        if len(raw) != size or head != b"%08x" % crc32c(body):
            return {}
        doc = json.loads(body)
        entries = {}
        for stamp, generation, unix in doc["stamps"][:MAX_BOOK_ENTRIES]:
            if _is_stamp(stamp) and _is_stamp(generation) and type(unix) is float:
                entries[_inode(stamp)] = (stamp, generation, unix)
        return entries
    except (ValueError, TypeError, KeyError, RecursionError):
        return {}


def _is_stamp(value: object) -> bool:
    return isinstance(value, str) and len(value) == 80 and not value.strip("0123456789abcdef")


def _pruned(entries: dict[str, tuple[str, str, float]], now: float) -> list[tuple[str, str, float]]:
    fresh = [entry for entry in entries.values() if now - entry[2] < BOOK_ENTRY_DAYS * 86400]
    return sorted(fresh, key=lambda entry: entry[2])[-MAX_BOOK_ENTRIES:]


def unlink_shared(root: pathlib.Path, keep: Sequence[str] = ()) -> None:
    """Unlink every regular file under ``root`` (a checkpoint being removed, in its run
    directory) that has names elsewhere, recording the stamps they leave in the run's
    book; where the run has no book, nothing is done. ``keep``: paths relative to
    ``root`` left in place. The walk holds each directory open and follows no symlink:
    a directory swapped for one meanwhile never leads it outside ``root``."""
    book = StampBook(root.parent)
    if not book.exists():
        return
    changes = []
    kept = {pathlib.PurePosixPath(k) for k in keep}
    for directory, _, files, directory_fd in os.fwalk(root, follow_symlinks=False):
        for name in files:
            relative = pathlib.PurePosixPath(pathlib.Path(directory, name).relative_to(root).as_posix())
            if relative in kept or not kept.isdisjoint(relative.parents):
                continue
            try:
                fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory_fd)
            except OSError:
                continue
            try:
                before = os.fstat(fd)
                if not stat.S_ISREG(before.st_mode) or before.st_nlink < 2:
                    continue
                os.unlink(name, dir_fd=directory_fd)
                changes.append((before, os.fstat(fd)))
            except OSError:
                continue
            finally:
                os.close(fd)
    book.record(changes)
