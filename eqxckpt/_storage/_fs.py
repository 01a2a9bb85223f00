"""Filesystem primitives of local checkpoints: hidden siblings, capped reads, fsync and
syncfs, and an atomic exchange of two directories."""

import ctypes
import errno
import functools
import os
import pathlib
import re
import shutil
import stat
import uuid
from collections.abc import Callable

from .._errors import warn_at_caller

# --- local filesystem commit ---------------------------------------------------------

# Hidden siblings of a checkpoint directory: a save being written ("tmp"), an
# old checkpoint being replaced ("old") or deleted ("deleting"). None is ever
# loaded; after a crash they are leftovers.
# Exactly the names `hidden_sibling` makes: cleanup deletes only these.
_HIDDEN_SIBLING = re.compile(r"^\.(.+)\.eqxckpt-(tmp|old|deleting)-[0-9a-f]{12}$")


def hidden_sibling(final: pathlib.Path, purpose: str) -> pathlib.Path:
    """A fresh hidden name beside ``final`` for ``purpose`` (tmp, old, deleting)."""
    return final.parent / f".{final.name}.eqxckpt-{purpose}-{uuid.uuid4().hex[:12]}"


def hidden_owner(name: str) -> str | None:
    """The checkpoint name a hidden sibling belongs to, or None if ``name`` is not one."""
    match = _HIDDEN_SIBLING.match(name)
    return None if match is None else match.group(1)


def read_capped(path: pathlib.Path | str, cap: int, dir_fd: int | None = None) -> bytes:
    """A small local file's bytes, read without following a symlink; past ``cap``
    only ``cap + 1`` bytes are read (the caller refuses it). ``OSError`` if it is
    missing or not a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    try:
        # Checked before a file object is made of it: one made of a directory fails
        # naming the descriptor, not the path.
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        # Sized by the file (plus one byte, to see one that grew past the cap): reading
        # ``cap + 1`` bytes would allocate that much for every small file.
        return f.read(min(cap, info.st_size) + 1)


def rewrite_in_place(root: int, key: str, raw: bytes, links: Callable[[os.stat_result], bool] = lambda _: True) -> None:
    """Make ``key`` under the directory open as ``root`` (a descriptor) hold ``raw``,
    rewriting the file itself (its other hard links see the new bytes), created where
    missing; no component is followed through a symlink.
    ``links(stat)`` says whether the file as opened may be rewritten (where its other hard
    links are). ``OSError`` if a component is a symlink, or the file is not what it should
    be or may not be rewritten."""
    *directories, name = key.split("/")
    fd = os.dup(root)
    try:
        for part in directories:
            if part in ("", ".", ".."):
                raise OSError(errno.EINVAL, "not a file of this checkpoint", key)
            try:
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                os.mkdir(part, dir_fd=fd)
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644, dir_fd=fd)
        try:
            info = os.fstat(out)
            if not stat.S_ISREG(info.st_mode):
                raise OSError(errno.EINVAL, "not a regular file", key)
            if not links(info):
                raise OSError(errno.EMLINK, "it has hard links outside the checkpoints beside it", key)
            view = memoryview(raw)
            while view:
                view = view[os.pwrite(out, view, len(raw) - len(view)) :]
            os.ftruncate(out, len(raw))
            os.fsync(out)
        finally:
            os.close(out)
        os.fsync(fd)
    finally:
        os.close(fd)


def stat_inside(root: pathlib.Path, key: str) -> os.stat_result | None:
    """The file ``key`` under ``root`` as it is, found without following a symlink in any
    component (``root`` included); None where there is no such file so reached."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        *directories, name = key.split("/")
        for part in directories:
            inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(fd)


def fsync_path(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_filesystem(root: pathlib.Path, opened: int | None = None) -> None:
    """Make every file and directory written below ``root`` durable.

    Linux ``syncfs`` flushes the whole filesystem holding ``root`` in one call,
    which lets the kernel write all chunk files in one pass and commit the
    journal once. Elsewhere, every file and directory below ``root`` is fsync'd.

    ``opened``: a descriptor of ``root`` opened before the files were written.
    ``syncfs`` reports the write errors of the filesystem since its descriptor was
    opened, and one opened only now misses those that another process's sync saw
    first (pages written back during the save, `start_writeback`'s or the kernel's).
    """
    syncfs = _libc_function("syncfs", [ctypes.c_int])
    if syncfs is None:
        for dirpath, _, filenames in os.walk(root, topdown=False):
            for name in filenames:
                fsync_path(pathlib.Path(dirpath, name))
            fsync_path(pathlib.Path(dirpath))
        return
    fd = os.open(root, os.O_RDONLY) if opened is None else opened
    try:
        if syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(root))
    finally:
        if opened is None:
            os.close(fd)


_SYNC_FILE_RANGE_WRITE = 2  # start writeback; wait for nothing


def start_writeback(fd: int) -> None:
    """Start writing a file's dirty pages to the disk without waiting (Linux
    ``sync_file_range``): the disk then works while the save goes on, and the
    ``syncfs`` that makes the save durable finds little left to write. Elsewhere
    nothing: durability never rests on this."""
    fn = _sync_file_range()
    if fn is not None:
        fn(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


@functools.cache
def _sync_file_range():
    return _libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])


def _libc_function(name: str, argtypes: list):
    """A function of the C library with errno captured, or None where it is missing."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    return fn


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Atomically swap two directories (Linux ``renameat2(RENAME_EXCHANGE)``).

    Returns False where the OS or filesystem cannot, so the caller falls back
    to two renames.
    """
    fn = _libc_function("renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint])
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: not supported here
        return False
    raise OSError(err, os.strerror(err), str(a))


_COPY_WARNED = False


def link_or_copy(source: pathlib.Path, target: pathlib.Path) -> None:
    """A hard link to ``source`` at ``target`` (the files are shared, and never written in
    place); a copy where the filesystem refuses links (another device, no link support),
    said once per process."""
    global _COPY_WARNED
    try:
        os.link(source, target, follow_symlinks=False)
        return
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        if not _COPY_WARNED:
            _COPY_WARNED = True
            warn_at_caller(
                f"Cannot hard-link {source} into the new checkpoint ({os.strerror(e.errno)}): unchanged leaves "
                "are copied instead of linked, which costs their bytes again.",
            )
    shutil.copyfile(source, target, follow_symlinks=False)
