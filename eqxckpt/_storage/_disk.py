"""`LocalStorage`: checkpoints in directories of a local filesystem.

A save writes a hidden sibling directory and renames it into place (or swaps
it with the checkpoint it replaces); ownership and liveness are ``flock``
locks on directories (`_locks`); the protocol: docs/concurrency.md.
"""

import concurrent.futures
import contextlib
import dataclasses
import errno
import os
import pathlib
import stat
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, BinaryIO

import tensorstore as ts

from .._errors import (
    CheckpointBusyError,
    CheckpointChangedError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ManifestError,
)
from .._leaf import StoredLeaf
from .._manifest import MAX_MANIFEST_BYTES, Manifest, parse_manifest
from .._paths import COMMIT_NAME, GROUP_METADATA, MANIFEST_NAME, group_file, group_locations, is_arrays_name
from ._backend import (
    MAX_ZARR_JSON_BYTES,
    TRUST_SPARSE,
    Pin,
    Staging,
    Storage,
    check_complete,
    corrupt,
    entry_order,
)
from ._disk_chunks import LocalChunkFiles
from ._fs import (
    exchange,
    fsync_path,
    hidden_sibling,
    link_or_copy,
    read_capped,
    rewrite_in_place,
    stat_inside,
    sync_filesystem,
)
from ._locks import (
    DirLock,
    create_staging,
    delete_local,
    join_staging,
    kept_sibling,
    remove_abandoned,
    remove_except,
    remove_tree,
    write_file,
)
from ._pins import LocalPin
from ._stamps import StampBook, settled, stamp_of


@dataclasses.dataclass(frozen=True)
class LocalStorage(Storage):
    """A checkpoint directory on a local filesystem."""

    path: pathlib.Path = pathlib.Path()

    @classmethod
    def at(cls, path: pathlib.Path) -> "LocalStorage":
        return cls({"driver": "file", "path": str(path) + "/"}, path)

    @property
    def local(self) -> pathlib.Path:
        return self.path

    def sub(self, name: str) -> "LocalStorage":
        return LocalStorage.at(self.path / name)

    def arrays(self, manifest: Manifest) -> "LocalStorage":
        """A copy of an object-store checkpoint keeps its arrays in the save's prefix: a
        directory inside this one, never a symlink (it could lead out of the checkpoint)."""
        if not manifest.arrays:
            return self
        where = self.path / manifest.arrays
        try:
            mode = os.lstat(where).st_mode
        except OSError as e:
            raise CorruptCheckpointError(
                f"{self.path}: the manifest keeps the arrays in {manifest.arrays}, which cannot be read "
                f"({e.strerror}). Restore the checkpoint from a copy or load an earlier one."
            ) from None
        if not stat.S_ISDIR(mode):
            raise CorruptCheckpointError(
                f"{where} is a symlink or special file, not the directory of arrays eqxckpt writes. Refusing to "
                "read it (it could point outside the checkpoint). Do not trust this checkpoint."
            )
        return self.sub(manifest.arrays)

    def user_path(self) -> pathlib.Path:
        return self.path

    def chunk_files(self) -> "LocalChunkFiles":
        book = StampBook(self.run_directory())
        return LocalChunkFiles(str(self.path), self._generations_read, lambda info: book.generations([info])[0])

    def run_directory(self) -> pathlib.Path:
        """The directory whose stamp book (`_stamps`) records this checkpoint's files: its
        parent (for the arrays of a copied object-store checkpoint, the checkpoint's)."""
        return self.path.parent.parent if is_arrays_name(self.path.name) else self.path.parent

    def generations(self, keys: Sequence[str]) -> list[str | None]:
        """Each file's stamp (`_stamps`: device, inode, size, modification and change
        times), or what the run's stamp book says a stamp eqxckpt's own links made stands
        for; None for a file that is missing, not a regular file, or modified less than
        `SETTLE_S` ago (a write may still be landing: nothing is vouched for by it)."""
        infos: list[os.stat_result | None] = []
        for key in keys:
            try:
                info = os.lstat(self.path / key)
            except OSError:
                info = None
            infos.append(info if info is not None and stat.S_ISREG(info.st_mode) and settled(info) else None)
        return StampBook(self.run_directory()).generations(infos)

    def __str__(self) -> str:
        return str(self.path)

    def read_manifest(self) -> tuple[Manifest, Pin]:
        local = self.path
        try:
            dir_fd = os.open(local, os.O_RDONLY | os.O_DIRECTORY)
        except NotADirectoryError:
            raise CheckpointNotFoundError(
                f"No checkpoint at {local}: it is a file, not a checkpoint directory."
            ) from None
        except FileNotFoundError:
            siblings = sorted(local.parent.iterdir()) if local.parent.is_dir() else []
            pending = [p for p in siblings if p.name.startswith(f".{local.name}.eqxckpt-tmp-")]
            if pending:
                raise IncompleteCheckpointError(
                    f"No checkpoint at {local}: a save to it is running or was interrupted before it committed "
                    f"(left {pending[0].name}). Load an earlier checkpoint."
                ) from None
            raise CheckpointNotFoundError(f"No checkpoint at {local}: the path does not exist.") from None
        except OSError as e:
            raise CheckpointNotFoundError(f"Cannot open {local}: {e.strerror or e}.") from None
        pin = LocalPin(local, dir_fd)
        try:
            return parse_manifest(self._manifest_bytes(dir_fd), str(local)), pin
        except IncompleteCheckpointError:
            # A directory moved away by an overwrite or retention loses its manifest first:
            # that is a checkpoint that changed while it was opened, not an uncommitted one.
            moved = pin.moved()
            pin.close()
            if moved:
                raise CheckpointChangedError(
                    f"The checkpoint at {local} was replaced or deleted by another process while it was "
                    "being opened. Open or load it again."
                ) from None
            raise
        except BaseException:
            pin.close()
            raise

    def _manifest_bytes(self, dir_fd: int) -> bytes:
        try:
            return read_capped(MANIFEST_NAME, MAX_MANIFEST_BYTES, dir_fd=dir_fd)  # a symlink could point anywhere
        except OSError as e:
            if e.errno != errno.ENOENT:
                raise ManifestError(
                    f"Cannot read the manifest of {self.path}: {e.strerror or e} (a symlink or special file "
                    "in place of eqxckpt.json is refused). The checkpoint is damaged or not trustworthy."
                ) from None
            run_directory = self.run_directory_error()
            if run_directory is not None:
                raise run_directory from None
            raise IncompleteCheckpointError(
                f"{self.path} has no {MANIFEST_NAME}: the save that made it never committed "
                "(it was interrupted, or this is not an eqxckpt checkpoint). Load an earlier "
                "checkpoint, or save again to this path with overwrite=True."
            ) from None

    def read_leaf_metadata(self, leaf: StoredLeaf) -> ts.Future:
        # On threads of their own: a restore starts every leaf's metadata at once, and on
        # a cold cache each file and directory looked up is a wait on the disk.
        promise, future = ts.Promise.new()
        try:
            _metadata_threads().submit(self._read_leaf_metadata, leaf, promise)
        except RuntimeError:  # no new work after shutdown began (a load in an atexit handler)
            self._read_leaf_metadata(leaf, promise)  # a promise set twice keeps its first value
        return future

    def _read_leaf_metadata(self, leaf: StoredLeaf, promise: ts.Promise) -> None:
        try:
            self.check_leaf_files(leaf)
            promise.set_result(read_capped(f"{self.path}/{leaf.path}/zarr.json", MAX_ZARR_JSON_BYTES))
        except FileNotFoundError:
            promise.set_result(None)
        except BaseException as e:  # raised by whoever waits for the future
            promise.set_exception(e)

    def check_leaf_files(self, leaf: StoredLeaf) -> int:
        """Check a leaf's files before TensorStore touches them; return their size.

        A checkpoint may come from anywhere: no component of the leaf's directory
        may be a symlink (it could lead out of the checkpoint), nothing below it
        may be anything but plain files and directories, and the files must hold
        at least the bytes the manifest declares, so a crafted shape cannot make
        the reader allocate memory that no data backs.
        """
        # Plain strings and os calls: pathlib's parsing cost more than the checks themselves.
        where = str(self.path)
        for part in leaf.path.split("/"):
            where = f"{where}/{part}"
            try:
                mode = os.lstat(where).st_mode
            except FileNotFoundError:
                raise corrupt(leaf, f"{where} does not exist") from None
            if not stat.S_ISDIR(mode):
                raise _unsafe(leaf, pathlib.Path(where))
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
                            raise _unsafe(leaf, pathlib.Path(entry.path))
        except OSError as e:  # vanished while listed: deleted under us
            raise corrupt(leaf, f"{e.filename}: {e.strerror}") from None
        if total < leaf.nbytes:
            raise corrupt(
                leaf,
                f"the manifest declares {leaf.nbytes} bytes ({leaf.dtype}"
                f"{list(leaf.data_shape)}) but its files hold only {total} on disk (sparse or "
                "truncated files are refused; on a compressing filesystem set "
                "EQXCKPT_TRUST_SPARSE=1 for checkpoints you trust)",
            )
        return total

    def unlisted(self, stored: set[str]) -> list[tuple[str, str]]:
        problems = []
        groups = {group_file(group) for group in group_locations(stored)}
        for dirpath, dirnames, filenames in os.walk(self.path):
            rel = os.path.relpath(dirpath, self.path).replace(os.sep, "/")
            if rel in stored:
                dirnames.clear()  # the leaf's own files were checked with it
                continue
            for name in filenames:
                where = name if rel == "." else f"{rel}/{name}"
                if where in groups:
                    if _read_small(self.path / where) != GROUP_METADATA:
                        problems.append((where, "a zarr group's metadata that is not what eqxckpt writes"))
                    continue
                if where not in (MANIFEST_NAME, COMMIT_NAME):
                    problems.append((where, "not named in the manifest (left over, or added after the save)"))
            for name in [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
                problems.append((name if rel == "." else f"{rel}/{name}", "a symlink inside the checkpoint"))
                dirnames.remove(name)
        return problems

    def check_target(self, overwrite: bool) -> None:
        """Refuse to replace a checkpoint without ``overwrite``, or anything else ever."""
        final = self.path
        if final.is_symlink():
            raise CheckpointError(
                f"Cannot save to {final}: it is a symlink (to {os.readlink(final)}). eqxckpt replaces a "
                "checkpoint by renaming a new directory into its place, which would replace the link, not what it "
                "points to: save to the target itself, or remove the link."
            )
        if final.exists() and not final.is_dir():
            raise CheckpointError(f"Cannot save to {final}: it is a file, not a directory.")
        if not final.is_dir():
            return
        is_checkpoint = (final / MANIFEST_NAME).exists()
        if is_checkpoint and not overwrite:
            raise CheckpointExistsError(
                f"A checkpoint already exists at {final}. Pass overwrite=True to replace it, or save to a new path."
            )
        if not is_checkpoint and any(final.iterdir()):
            raise CheckpointExistsError(
                f"{final} exists and is not an eqxckpt checkpoint (no {MANIFEST_NAME}); refusing to "
                "replace it. Choose another path or remove it yourself."
            )

    def begin_save(self, paths: list[str], overwrite: bool) -> "LocalStaging":
        self.check_target(overwrite)
        remove_abandoned(self.path.parent, lambda owner: owner == self.path.name)
        tmp, lock = create_staging(self.path)
        return LocalStaging(self, tmp, lock, owner=True, overwrite=overwrite)

    def join_save(self, where: str) -> "LocalStaging":
        tmp = pathlib.Path(where)
        # Held while this process writes: a cleaner must see it as alive.
        return LocalStaging(self, tmp, join_staging(tmp), owner=False, overwrite=False)

    def list_entries(self) -> list[tuple[str, str]]:
        try:
            found = list(os.scandir(self.path))
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for entry in sorted(found, key=lambda e: e.name):
            if entry.name.startswith("."):
                continue  # hidden: saves in progress, leftovers, the user's own
            committed = entry.is_dir(follow_symlinks=False) and os.path.lexists(os.path.join(entry.path, MANIFEST_NAME))
            out.append((entry.name, "committed" if committed else "other"))
        return out

    def clean_leftovers(self, entries: Callable[[str], bool]) -> list[str]:
        remove_abandoned(self.path, entries)
        return []

    def leaf_files(self, path: str) -> dict[str, int] | None:
        parts = path.split("/")
        try:
            # The leaf's directory, and each above it, are real directories: never a way out.
            if not all(
                stat.S_ISDIR(os.lstat(self.path.joinpath(*parts[:n])).st_mode) for n in range(1, len(parts) + 1)
            ):
                return None
            return _local_files(self.path / path, prefix=f"{path}/", plain=True)
        except OSError:
            return None

    def sharers(self, manifest: Manifest, leaf: StoredLeaf) -> list[str]:
        linked: dict[str, tuple[int, int]] = {}  # the leaf's files that have other names
        try:
            directory = self.arrays(manifest).path / leaf.path
            for key in _local_files(directory) or {}:
                info = os.lstat(directory / key)
                if info.st_nlink > 1:
                    linked[key] = (info.st_dev, info.st_ino)
        except (OSError, CheckpointError):
            return []
        if not linked:
            return []  # the common case: no sibling to look at
        found = []
        parent = LocalStorage.at(self.path.parent)
        for name, state in parent.entries():
            if state != "committed" or name == self.path.name:
                continue
            for key, inode in linked.items():
                try:
                    info = os.lstat(self.path.parent / name / leaf.path / key)
                except OSError:
                    continue
                if (info.st_dev, info.st_ino) == inode:
                    found.append(name)
                    break
        return sorted(found, key=entry_order)

    def beside(self) -> list[Storage]:
        parent = LocalStorage.at(self.path.parent)
        return [
            LocalStorage.at(self.path.parent / name)
            for name, state in parent.entries()
            if state == "committed" and name != self.path.name and not (self.path.parent / name).is_symlink()
        ]

    def mend(self, key: str, raw: bytes, pin: Pin) -> None:
        if not isinstance(pin, LocalPin) or pin.fd < 0 or not self.path.is_relative_to(pin.path):
            raise CheckpointWriteError(f"{self.path} cannot be mended: it is not inside the checkpoint held open.")
        # The key as the checkpoint names it: these arrays may be a directory inside it.
        inside = "/".join([*self.path.relative_to(pin.path).parts, key])
        checkpoint = LocalStorage.at(pin.path)

        def linked_beside_only(info: os.stat_result) -> bool:
            # Every other name of the file is the same file of a committed checkpoint beside
            # this one, reached without a symlink, each directory counted once (a bind mount
            # of one is the same directory): rewriting it changes nothing outside them.
            if info.st_nlink == 1:
                return True
            held = os.fstat(pin.fd)
            seen, names = {(held.st_dev, held.st_ino)}, 1  # its own
            for other in checkpoint.beside():
                assert isinstance(other, LocalStorage)
                root = stat_inside(other.path.parent, other.path.name)
                if root is None or (root.st_dev, root.st_ino) in seen:
                    continue
                seen.add((root.st_dev, root.st_ino))
                found = stat_inside(other.path, inside)
                names += found is not None and (found.st_dev, found.st_ino) == (info.st_dev, info.st_ino)
            return names == info.st_nlink

        try:
            rewrite_in_place(pin.fd, inside, raw, linked_beside_only)
        except OSError as e:
            raise CheckpointWriteError(f"{self.path / key} could not be rewritten: {e}") from e

    def delete(self, keep: Sequence[str] = ()) -> bool:
        return delete_local(self.path, keep)

    def read_small(self, name: str, cap: int) -> bytes | None:
        try:
            return read_capped(self.path / name, cap)  # never through a symlink
        except FileNotFoundError:
            return None

    def create_once(self, name: str, raw: bytes) -> bool:
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            write_file(self.path / name, lambda f: f.write(raw), overwrite=False)
        except CheckpointExistsError:
            return False
        return True

    def put_file(self, name: str, pieces: Iterable[Any], overwrite: bool, seen: str | None = None) -> str:
        self.path.mkdir(parents=True, exist_ok=True)

        def body(f: BinaryIO) -> None:
            for piece in pieces:
                f.write(piece)

        return write_file(self.path / name, body, overwrite)

    def file_stamp(self, name: str) -> str | None:
        try:
            return stamp_of(os.lstat(self.path / name))
        except FileNotFoundError:
            return None

    def remove_file(self, name: str) -> bool:
        target = self.path / name
        if os.path.isdir(target) and not os.path.islink(target):
            raise CheckpointWriteError(f"Cannot remove {target}: it is a directory, not a file eqxckpt writes there.")
        try:
            target.unlink()
        except FileNotFoundError:
            return False
        fsync_path(self.path)
        return True

    def file_exists(self, name: str) -> bool:
        return os.path.lexists(self.path / name)

    @contextlib.contextmanager
    def publishing(self) -> Iterator[None]:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointWriteError(
                f"Cannot make the directory {self.path}: {e.strerror or e}. Nothing was written."
            ) from None
        # The directory's own lock (`DirLock`, as a save's staging directory is held): no
        # file is added to the model's directory. A filesystem without locks holds nothing.
        lock = DirLock.take(self.path, exclusive=True, follow_symlinks=True)
        if lock is None:
            raise CheckpointBusyError(
                f"Another writer is writing a model into {self.path} now; wait for it, or write elsewhere."
            )
        with lock:
            yield


class LocalStaging(Staging):
    """A save into a hidden sibling directory, renamed into place to commit."""

    def __init__(self, final: LocalStorage, tmp: pathlib.Path, lock: DirLock | None, owner: bool, overwrite: bool):
        self.final = final
        self.overwrite = overwrite
        self.tmp = tmp
        self.storage = LocalStorage.at(tmp)
        self.where = str(tmp)
        self.lock = lock
        self.owner = owner

    def sync(self) -> None:
        # Durable before the commit phase: every process syncs what it wrote, through the
        # staging directory's lock, held since before its first write (its write errors).
        sync_filesystem(self.tmp, self.lock.fd if self.lock is not None else None)

    def link_files(self, base: Storage, keys: list[str]) -> None:
        assert isinstance(base, LocalStorage)
        changes = []
        for key in keys:
            (self.tmp / key).parent.mkdir(parents=True, exist_ok=True)
            before = os.lstat(base.path / key)
            link_or_copy(base.path / key, self.tmp / key)
            changes.append((before, os.lstat(base.path / key)))
        # A link changes the file's change time, not its bytes: the new checkpoint's run's
        # book says so (the base's directory, perhaps another, is only read from).
        StampBook(self.final.run_directory()).record(changes)

    def commit(self, manifest: Manifest, expected: dict[str, int]) -> None:
        check_complete(_local_files(self.tmp) or {}, expected)
        with open(self.tmp / MANIFEST_NAME, "wb") as f:
            f.write(manifest.to_bytes())
            f.flush()
            os.fsync(f.fileno())
        fsync_path(self.tmp)  # the arrays below were synced in the write phase
        self._rename_into_place()
        fsync_path(self.final.path.parent)

    def _rename_into_place(self) -> None:
        """Move the finished temporary directory into place, atomically."""
        tmp, final, overwrite = self.tmp, self.final.path, self.overwrite
        self.final.check_target(overwrite)  # again: another writer may have committed meanwhile
        if not overwrite:
            # One rename, whatever happened since the check: it fails (ENOTEMPTY/EEXIST) if
            # anything is there now, so a checkpoint committed meanwhile is never replaced.
            try:
                os.rename(tmp, final)
            except OSError as e:
                raise CheckpointExistsError(f"Another save committed {final} first; this one was discarded.") from e
            return
        if not final.exists():
            try:
                os.rename(tmp, final)
                return
            except OSError:  # another save committed first: replace it below
                self.final.check_target(overwrite)
        # Replace: swap atomically where the OS can, so a reader always sees a
        # complete checkpoint; else move the old one aside first (it stays complete).
        if exchange(tmp, final):
            self._remove_replaced(tmp)  # now the old checkpoint; a reader of it notices and reads again
            return
        # The old one is held (a shared lock moves with the directory), so no cleaner
        # removes it while it is aside, and it goes back if the second rename fails.
        with DirLock.take(final, exclusive=False) or contextlib.nullcontext():
            aside = hidden_sibling(final, "old")
            os.rename(final, aside)
            try:
                os.rename(tmp, final)
            except BaseException:
                os.rename(aside, final)
                raise
        self._remove_replaced(aside)

    def _remove_replaced(self, old: pathlib.Path) -> None:
        """Remove the checkpoint this save replaced, now at ``old``, but for the files in it
        eqxckpt did not write (`unwritten`, found now: `keep_replaced`), left in a directory
        beside it (`kept_at`)."""
        self.keep_replaced = [] if self.unwritten is None else self.unwritten(LocalStorage.at(old))
        if not self.keep_replaced:
            remove_tree(old)
            return
        remove_except(old, self.keep_replaced)
        self.kept_at = kept_sibling(self.final.path, "replaced")
        os.rename(old, self.kept_at)

    def abort(self, error: BaseException) -> None:
        if self.owner:
            remove_tree(self.tmp)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


_METADATA_THREADS = 8
_metadata_pool: concurrent.futures.ThreadPoolExecutor | None = None
_metadata_pool_made = threading.Lock()


def _metadata_threads() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that read leaves' metadata from local disks (started on first use;
    never the I/O threads, whose tasks may wait for metadata)."""
    global _metadata_pool
    with _metadata_pool_made:
        if _metadata_pool is None:
            _metadata_pool = concurrent.futures.ThreadPoolExecutor(_METADATA_THREADS, thread_name_prefix="eqxckpt-meta")
        return _metadata_pool


def _forget_metadata_threads() -> None:
    """In a forked child: the parent's pool has no threads here, yet counts its idle ones
    and would queue work that no thread runs (and another thread may have held the lock)."""
    global _metadata_pool, _metadata_pool_made
    _metadata_pool, _metadata_pool_made = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_metadata_threads)


def _local_files(root: pathlib.Path, prefix: str = "", plain: bool = False) -> dict[str, int] | None:
    """``{prefix + relative path: size}`` of every file below ``root``, links not followed;
    with ``plain``, None if anything there is neither a directory nor a regular file."""
    found: dict[str, int] = {}
    pending = [(prefix, str(root))]
    while pending:
        rel, where = pending.pop()
        with os.scandir(where) as entries:
            for entry in entries:
                key = f"{rel}{entry.name}"
                if entry.is_dir(follow_symlinks=False):
                    pending.append((key + "/", entry.path))
                elif plain and not entry.is_file(follow_symlinks=False):
                    return None  # a link or device: never taken into another checkpoint
                else:
                    found[key] = entry.stat(follow_symlinks=False).st_size
    return found


def _unsafe(leaf: StoredLeaf, where: pathlib.Path) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"Leaf {leaf.path!r}: {where} is a symlink or special file, not the plain files eqxckpt writes. "
        "Refusing to read it (it could point outside the checkpoint). Do not trust this checkpoint.",
        leaf_path=leaf.path,
    )


def _read_small(file: pathlib.Path) -> bytes | None:
    """A small file's bytes (at most 4 KiB are read), or None if it cannot be read."""
    try:
        return read_capped(file, 4096)
    except OSError:
        return None
