"""Local filesystems: ``flock`` locks on directories and files, the staging directory a
save writes into, a file written whole and atomically beside its place (`write_file`), and
removing what no live process holds (abandoned staging, a deleted checkpoint). Who takes
which lock, and when: docs/concurrency.md ("Local filesystems").
"""

import errno
import fcntl
import os
import pathlib
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

from .._errors import CheckpointError, CheckpointExistsError, CheckpointWriteError
from .._paths import MANIFEST_NAME
from ._fs import fsync_path, hidden_owner, hidden_sibling


class DirLock:
    """A ``flock`` held on an open directory; released by `release` or when the
    process dies. ``supported`` is False where the filesystem has no locks."""

    def __init__(self, fd: int, supported: bool = True):
        self.fd = fd
        self.supported = supported

    @classmethod
    def take(
        cls, path: pathlib.Path | str, *, exclusive: bool, follow_symlinks: bool = False, dir_fd: int | None = None
    ) -> "DirLock | None":
        """Lock the directory at ``path`` without waiting.

        Returns None if a conflicting lock is held, or if ``path`` does not name
        a directory (any more): the name is checked again once the lock is held,
        since it may have been removed or replaced in between.
        """
        flags = os.O_RDONLY | os.O_DIRECTORY | (0 if follow_symlinks else os.O_NOFOLLOW)
        try:
            fd = os.open(path, flags, dir_fd=dir_fd)
        except OSError:
            return None
        supported = True
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                return None
            supported = False  # no locks on this filesystem: the caller decides what that allows
        lock = cls(fd, supported)
        if not lock.names(path, follow_symlinks=follow_symlinks, dir_fd=dir_fd):
            lock.release()
            return None
        return lock

    def names(self, path: pathlib.Path | str, *, follow_symlinks: bool = True, dir_fd: int | None = None) -> bool:
        """Whether ``path`` still names the locked directory."""
        try:
            now = os.stat(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
        except OSError:
            return False
        held = os.fstat(self.fd)
        return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing drops the lock
            self.fd = -1

    def __enter__(self) -> "DirLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def flock_within(fd: int, lock: int, wait_s: float) -> bool:
    """Take the ``flock`` ``lock`` on ``fd``, waiting at most ``wait_s``: True once held, or
    where the filesystem has no locks; False if another holder kept it all that time.

    ```python
    flock_within(fd, fcntl.LOCK_EX, 1.0)
    ```
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, lock | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True  # no locks here (ENOLCK, EOPNOTSUPP): the caller goes on unlocked
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def create_staging(final: pathlib.Path) -> tuple[pathlib.Path, DirLock]:
    """A new hidden directory beside ``final`` for a save, locked by this process."""
    final.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(8):
        tmp = hidden_sibling(final, "tmp")
        tmp.mkdir()
        # A cleaner may have removed it between mkdir and flock (it was unlocked
        # then); take() sees that, and we start over with a new name.
        lock = DirLock.take(tmp, exclusive=False)
        if lock is not None:
            return tmp, lock
    raise CheckpointWriteError(
        f"Could not create a staging directory beside {final} that stays ours; is another "
        "process removing directories there?"
    )


def join_staging(tmp: pathlib.Path) -> DirLock:
    """Lock a staging directory another process of the same save created."""
    lock = DirLock.take(tmp, exclusive=False)
    if lock is None:
        raise CheckpointWriteError(
            f"The save's staging directory {tmp} is gone: process 0 of the save failed or "
            "was killed. Nothing was committed."
        )
    return lock


def remove_tree(path: pathlib.Path) -> bool:
    """Remove a directory tree we own; True if it is gone (errors are not fatal:
    what remains is unlocked and a later cleanup removes it)."""
    from ._stamps import unlink_shared  # (the stamp book is built on this module's primitives)

    unlink_shared(path)
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


def remove_except(root: pathlib.Path, keep: Sequence[str]) -> None:
    """Remove everything in the directory ``root`` but the paths ``keep`` names (relative:
    files, or directories kept whole) and the directories leading to them. A symlink is
    removed, never followed."""
    from ._stamps import unlink_shared

    unlink_shared(root, keep)
    kept = {pathlib.PurePosixPath(k) for k in keep}
    leading = {parent for k in kept for parent in k.parents}
    for dirpath, dirnames, filenames in os.walk(root, topdown=True):
        relative = pathlib.PurePosixPath(os.path.relpath(dirpath, root).replace(os.sep, "/"))
        for name in list(dirnames):
            path = relative / name if str(relative) != "." else pathlib.PurePosixPath(name)
            full = os.path.join(dirpath, name)
            if path in kept or (path in leading and not os.path.islink(full)):
                if path in kept:
                    dirnames.remove(name)  # kept whole
                continue
            dirnames.remove(name)
            if os.path.islink(full):
                os.unlink(full)
            else:
                shutil.rmtree(full, ignore_errors=True)
        for name in filenames:
            path = relative / name if str(relative) != "." else pathlib.PurePosixPath(name)
            if path not in kept:
                os.unlink(os.path.join(dirpath, name))


def remove_abandoned(parent: pathlib.Path, owners: Callable[[str], bool]) -> list[str]:
    """Remove hidden siblings in ``parent`` of the checkpoints whose names ``owners``
    accepts, that no live process holds. Returns the names removed."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for entry in entries:
        name = hidden_owner(entry.name)
        if name is None or not owners(name) or not entry.is_dir(follow_symlinks=False):
            continue
        lock = DirLock.take(entry.path, exclusive=True)
        if lock is None or not lock.supported:
            if lock is not None:
                lock.release()
            continue  # alive (a writer, reader or deleter holds it), or no way to tell
        with lock:
            if remove_tree(pathlib.Path(entry.path)):
                removed.append(entry.name)
    return removed


def create_locked_file(final: pathlib.Path) -> tuple[pathlib.Path, BinaryIO]:
    """A new hidden temporary file beside ``final``, open for writing and holding a shared
    lock: while it is held, no `remove_abandoned_files` removes it (a killed writer's
    lock goes with it). As `create_staging` does for directories, a file a cleaner
    removed between its creation and the lock is noticed, and a new name tried."""
    for _ in range(8):
        tmp = hidden_sibling(final, "tmp")
        f = open(tmp, "xb")  # noqa: SIM115 - returned open, the caller closes it
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                return tmp, f  # no locks here: cleanup cannot tell either, and removes nothing
            f.close()  # a cleaner took it before our lock, and is removing it: another name
            continue
        held, now = os.fstat(f.fileno()), _stat_or_none(tmp)
        if now is not None and (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
            return tmp, f
        f.close()
    raise CheckpointWriteError(
        f"Could not create a temporary file beside {final} that stays ours; is another process removing files there?"
    )


def _stat_or_none(path: pathlib.Path) -> os.stat_result | None:
    try:
        return os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None


def remove_abandoned_files(final: pathlib.Path) -> list[str]:
    """Remove the hidden temporary files of ``final`` (``.NAME.eqxckpt-tmp-*``, a plain
    file) that no live writer holds; returns the names removed."""
    removed = []
    try:
        entries = list(os.scandir(final.parent))
    except OSError:
        return removed
    for entry in entries:
        if hidden_owner(entry.name) != final.name or not entry.is_file(follow_symlinks=False):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held, now = os.fstat(fd), os.stat(entry.path, follow_symlinks=False)
            if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
                os.unlink(entry.path)
                removed.append(entry.name)
        except OSError:
            pass  # a live writer holds it, it is gone already, or there are no locks
        finally:
            os.close(fd)
    return removed


def kept_sibling(final: pathlib.Path, why: str) -> pathlib.Path:
    """Where the files eqxckpt did not write in checkpoint ``final`` go when it is deleted
    (``why``: ``kept``) or replaced (``replaced``): a visible directory beside it,
    ``<name>.<why>-<hex>``, which no scan takes for a checkpoint and no cleanup removes."""
    return final.with_name(f"{final.name}.{why}-{uuid.uuid4().hex[:8]}")


def delete_local(final: pathlib.Path, keep: Sequence[str] = ()) -> bool:
    """Delete a committed checkpoint, unless a reader holds it; the files ``keep`` names
    (relative to it: eqxckpt did not write them) are kept, as they were, in a directory
    beside it (`kept_sibling`).

    Returns False (nothing done) while it is being read; True once it is gone.
    """
    lock = DirLock.take(final, exclusive=True)
    if lock is None:
        return not os.path.lexists(final)
    with lock:  # (without flock support, readers cannot be waited for: they notice and read again)
        _check_removable(final)  # before anything changes: the checkpoint stays whole and listed
        aside = hidden_sibling(final, "deleting")
        try:
            os.rename(final, aside)
        except FileNotFoundError:
            return True
        fsync_path(final.parent)
        try:  # uncommitted first, so what remains of a crash is never loaded
            os.unlink(aside / MANIFEST_NAME)
        except FileNotFoundError:
            pass
        if keep:
            # Beside it, under a name of its own: the checkpoint's name is free to be saved again.
            remove_except(aside, keep)
            os.rename(aside, kept_sibling(final, "kept"))
            return True
        if not remove_tree(aside):
            raise OSError(errno.EACCES, f"{aside} could not be removed whole (uncommitted, it is never loaded)")
    return True


def _check_removable(root: pathlib.Path) -> None:
    """Raise `PermissionError` naming the first directory of ``root`` whose entries this
    process cannot remove (or ``root``'s parent, which must let it be renamed)."""
    for where in [root.parent, root] + [pathlib.Path(d) for d, _, _ in os.walk(root) if d != str(root)]:
        if not os.access(where, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "Permission denied: cannot remove what it holds", str(where))


def write_file(final: pathlib.Path, body: Callable[[BinaryIO], object], overwrite: bool) -> str:
    """Write a file whole, durably and atomically: ``body`` fills a hidden temporary
    beside ``final``, which `commit_file` then moves into place.

    **Returns:** the stamp (`stamp_of`) of the file written, as committed: what
    ``final``'s stamp is for as long as it is this file."""
    remove_abandoned_files(final)  # what a killed writer of this file left
    tmp, f = create_locked_file(final)  # locked until the commit: no cleaner takes it from under us
    written = -1
    try:
        with f:
            body(f)
            f.flush()
            os.fsync(f.fileno())
            commit_file(tmp, final, overwrite)
            written = os.dup(f.fileno())  # the inode, whatever is renamed over its name meanwhile
        fsync_path(final.parent)
    finally:
        tmp.unlink(missing_ok=True)  # a hard-link commit leaves the temporary name behind
    from ._stamps import stamp_of  # (which writes its book with this function)

    try:  # after the temporary name went: unlinking it changed the inode's ctime
        return stamp_of(os.fstat(written))
    finally:
        os.close(written)


def commit_file(tmp: pathlib.Path, final: pathlib.Path, overwrite: bool) -> None:
    """Move the written file into place. Without ``overwrite`` a hard link makes it
    appear only if nothing is there, atomically, so a file another process
    created meanwhile is never replaced."""
    if final.is_dir():
        raise CheckpointError(f"Cannot write {final}: it is a directory.")
    if overwrite:
        os.replace(tmp, final)
        return
    try:
        os.link(tmp, final)
    except FileExistsError:
        raise file_exists_error(final) from None
    except OSError:  # a filesystem without hard links: check, then rename
        if final.exists():
            raise file_exists_error(final) from None
        os.rename(tmp, final)


def file_exists_error(final: pathlib.Path) -> CheckpointExistsError:
    """The error for a file that a write without ``overwrite`` found there."""
    return CheckpointExistsError(f"{final} exists; pass overwrite=True to replace it, or write elsewhere.")
