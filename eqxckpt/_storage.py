"""Where checkpoints live: one `Storage` type per backend.

Each backend owns its side of the concurrency protocol (see `_lease`): how a
save stages and commits, what cleanup may remove, how a checkpoint is deleted,
how a directory of checkpoints is listed, how the manifest is read, and which
checks a leaf's files get before TensorStore reads them.

- `LocalStorage`: a directory on a local filesystem. Saves write a hidden
  sibling and rename it into place; locks are ``flock``.
- `ObjectStorage`: a prefix in an object store (S3, GCS, memory). Saves take a
  lease object and commit by writing the manifest last.
"""

import abc
import bisect
import contextlib
import dataclasses
import errno
import itertools
import math
import os
import pathlib
import stat
from typing import Any

import numpy as np
import tensorstore as ts

from ._errors import (
    CheckpointBusyError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ManifestError,
)
from ._leaf import StoredLeaf
from ._lease import (
    DirLock,
    Lease,
    LocalPin,
    StorePin,
    create_staging,
    delete_leaf_keys,
    delete_local,
    describe_lease,
    is_stale,
    join_staging,
    read_lease,
    reclaim,
    remove_abandoned,
    remove_tree,
    uncommit,
    warn_if_not_atomic,
)
from ._manifest import MAX_MANIFEST_BYTES, Manifest, parse_manifest
from ._paths import LEASE_NAME, MANIFEST_NAME, validate_path
from ._store import (
    chunk_shape,
    exchange,
    fsync_path,
    hidden_sibling,
    is_storage_error,
    read_capped,
    reason,
    shared_context,
    sync_filesystem,
)

Pin = LocalPin | StorePin
# Where a checkpoint is: a local path, a URL (file://, memory://, s3://, gs://), or a TensorStore kvstore spec.
CheckpointPath = str | os.PathLike[str] | dict[str, Any]
MAX_ZARR_JSON_BYTES = 64 * 1024
NOTHING_COMMITTED = (
    "Nothing was committed and any previous checkpoint at this place is intact; free space or fix "
    "permissions, then save again."
)
# Compressing filesystems (ZFS, btrfs) may allocate fewer blocks than a file's
# size for data that is genuinely there (zeros): this trusts apparent sizes.
TRUST_SPARSE = os.environ.get("EQXCKPT_TRUST_SPARSE", "") == "1"


@dataclasses.dataclass(frozen=True)
class Storage(abc.ABC):
    """A checkpoint's root: a TensorStore kvstore spec, and the protocol of its backend."""

    kvstore: dict[str, Any]

    def child(self, relpath: str) -> dict[str, Any]:
        """kvstore spec of a (validated) location inside the checkpoint."""
        relpath = validate_path(relpath)
        spec = dict(self.kvstore)
        spec["path"] = spec.get("path", "") + relpath + "/"
        return spec

    def open_kvstore(self) -> ts.KvStore:
        """The checkpoint's root as an open TensorStore key-value store."""
        return ts.KvStore.open(self.kvstore, context=shared_context()).result()

    @property
    def local(self) -> pathlib.Path | None:
        """The directory, for local storage; None for object stores."""
        return None

    @abc.abstractmethod
    def sub(self, name: str) -> "Storage":
        """The storage of an entry of this directory (a manager's step)."""

    @abc.abstractmethod
    def argument(self) -> CheckpointPath:
        """What `save`, `load` and `open` accept to name this place (a path, or a kvstore spec)."""

    # -- reading ------------------------------------------------------------------------

    @abc.abstractmethod
    def read_manifest(self) -> tuple[Manifest, Pin]:
        """A committed checkpoint's manifest, or an error saying exactly why there is none,
        with what pins that checkpoint (so a reader can tell if it was replaced meanwhile)."""

    @abc.abstractmethod
    def read_leaf_metadata(self, leaf: StoredLeaf) -> ts.Future:
        """Start reading a leaf's ``zarr.json``, after checking its files may be read."""

    def unlisted(self, stored: set[str]) -> list[tuple[str, str]]:
        """Files a checkpoint holds that its manifest does not name (where they can be listed)."""
        return []

    # -- saving -------------------------------------------------------------------------

    def check_target(self, overwrite: bool) -> None:
        """Refuse early (before a snapshot is taken) what `begin_save` will refuse."""
        return None

    @abc.abstractmethod
    def begin_save(self, paths: list[str], overwrite: bool) -> "Staging":
        """Claim this place for a save of the leaves at ``paths``; where to write them."""

    @abc.abstractmethod
    def join_save(self, where: str) -> "Staging":
        """The staging another process began (``where`` is its `Staging.where`)."""

    # -- a directory of checkpoints -----------------------------------------------------

    @abc.abstractmethod
    def entries(self) -> list[tuple[str, str]]:
        """(name, state) for each visible entry, sorted: ``committed`` (holds a committed
        checkpoint), ``busy`` (a save or deletion holds it) or ``other``."""

    @abc.abstractmethod
    def clean_leftovers(self) -> None:
        """Remove what interrupted saves and deletions left, where provably abandoned and eqxckpt's."""

    @abc.abstractmethod
    def delete(self) -> bool:
        """Uncommit, then remove, this checkpoint; False if it is in use (try again later)."""


class Staging(abc.ABC):
    """A save in progress: where its arrays go, and how it commits or is abandoned."""

    storage: Storage
    where: str = ""  # told to the other processes of a multi-process save

    def sync(self) -> None:
        """Make what this process wrote durable."""
        return None

    @abc.abstractmethod
    def commit(self, manifest: Manifest, expected: dict[str, int]) -> None:
        """Check every expected file is there, write the manifest, make it visible."""

    def abort(self, error: BaseException) -> None:
        """Remove what this save wrote (if this process owns it); may add a note to ``error``."""
        return None

    def release(self) -> None:
        """Give up what this process holds (locks)."""
        return None


def expected_files(leaves: list[tuple[StoredLeaf, tuple[int, ...] | None]]) -> dict[str, int]:
    """``{key: size}`` of every file the arrays must consist of: each leaf's
    ``zarr.json`` (size -1: any) and every chunk (the chunk's bytes + a crc32c).
    Each leaf comes with the shard shape its chunks tile (None: whole)."""
    expected: dict[str, int] = {}
    for leaf, shard in leaves:
        shape, itemsize = leaf.data_shape, np.dtype(leaf.dtype).itemsize
        chunk = chunk_shape(shape, itemsize, shard)
        expected[f"{leaf.path}/zarr.json"] = -1
        if 0 in shape:
            continue
        size = math.prod(chunk) * itemsize + 4
        if not shape:
            expected[f"{leaf.path}/c"] = size
            continue
        grid = [range(-(-n // c)) for n, c in zip(shape, chunk)]
        for index in itertools.product(*grid):
            expected[f"{leaf.path}/c/" + "/".join(map(str, index))] = size
    return expected


def _check_complete(found: dict[str, int], expected: dict[str, int]) -> None:
    """Refuse to commit unless every leaf's metadata and chunks are there, whole (size -1: unknown)."""
    for key, size in expected.items():
        have = found.get(key)
        if have is None or (size >= 0 and have >= 0 and have != size):
            what = "is missing" if have is None else f"holds {have} bytes, not {size}"
            raise CheckpointWriteError(
                f"Before committing, {key} {what}: the save's files were damaged or removed while it ran "
                f"(another process, or the disk). {NOTHING_COMMITTED}"
            )


def corrupt(leaf: StoredLeaf | Any, error: BaseException | str) -> CorruptCheckpointError:
    """The error for a leaf whose stored data cannot be read back intact."""
    return CorruptCheckpointError(
        f"Leaf {leaf.path!r} is corrupt or missing on disk: {reason(error)}. Restore the checkpoint "
        "from a copy or load an earlier one; `eqxckpt inspect` still shows what it held.",
        path=leaf.path,
    )


# --- local filesystems ---------------------------------------------------------------------


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

    def argument(self) -> pathlib.Path:
        return self.path

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
            raise IncompleteCheckpointError(
                f"{self.path} has no {MANIFEST_NAME}: the save that made it never committed "
                "(it was interrupted, or this is not an eqxckpt checkpoint). Load an earlier "
                "checkpoint, or save again to this path with overwrite=True."
            ) from None

    def read_leaf_metadata(self, leaf: StoredLeaf) -> ts.Future:
        self.stored_bytes(leaf)
        promise, future = ts.Promise.new()
        try:
            promise.set_result(read_capped(self.path / leaf.path / "zarr.json", MAX_ZARR_JSON_BYTES))
        except OSError as e:
            promise.set_exception(e)
        return future

    def stored_bytes(self, leaf: StoredLeaf) -> int:
        """Check a leaf's files before TensorStore touches them; return their size.

        A checkpoint may come from anywhere: no component of the leaf's directory
        may be a symlink (it could lead out of the checkpoint), nothing below it
        may be anything but plain files and directories, and the files must hold
        at least the bytes the manifest declares, so a crafted shape cannot make
        the reader allocate memory that no data backs.
        """
        where = self.path
        for part in leaf.path.split("/"):
            where = where / part
            try:
                mode = os.lstat(where).st_mode
            except FileNotFoundError:
                raise corrupt(leaf, f"{where} does not exist") from None
            if not stat.S_ISDIR(mode):
                raise _unsafe(leaf, where)
        total = 0
        pending = [where]
        try:
            while pending:
                with os.scandir(pending.pop()) as entries:
                    for entry in entries:
                        if entry.is_dir(follow_symlinks=False):
                            pending.append(pathlib.Path(entry.path))
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
        for dirpath, dirnames, filenames in os.walk(self.path):
            rel = os.path.relpath(dirpath, self.path).replace(os.sep, "/")
            if rel in stored:
                dirnames.clear()  # the leaf's own files were checked with it
                continue
            for name in filenames:
                where = name if rel == "." else f"{rel}/{name}"
                if where != MANIFEST_NAME:
                    problems.append((where, "not named in the manifest (left over, or added after the save)"))
            for name in [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
                problems.append((name if rel == "." else f"{rel}/{name}", "a symlink inside the checkpoint"))
                dirnames.remove(name)
        return problems

    def check_target(self, overwrite: bool) -> None:
        """Refuse to replace a checkpoint without ``overwrite``, or anything else ever."""
        final = self.path
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
        remove_abandoned(self.path.parent, owner=self.path.name)
        tmp, lock = create_staging(self.path)
        return LocalStaging(self, tmp, lock, owner=True, overwrite=overwrite)

    def join_save(self, where: str) -> "LocalStaging":
        tmp = pathlib.Path(where)
        # Held while this process writes: a cleaner must see it as alive.
        return LocalStaging(self, tmp, join_staging(tmp), owner=False, overwrite=False)

    def entries(self) -> list[tuple[str, str]]:
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

    def clean_leftovers(self) -> None:
        remove_abandoned(self.path)

    def delete(self) -> bool:
        return delete_local(self.path)


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
        # Durable before the commit phase: every process syncs what it wrote.
        sync_filesystem(self.tmp)

    def commit(self, manifest: Manifest, expected: dict[str, int]) -> None:
        _check_complete(_local_files(self.tmp), expected)
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
        if not final.exists():
            try:
                os.rename(tmp, final)
                return
            except OSError as e:  # another save committed first (ENOTEMPTY/EEXIST)
                if not overwrite:
                    raise CheckpointExistsError(f"Another save committed {final} first; this one was discarded.") from e
                self.final.check_target(overwrite)  # with overwrite=True, replace it below
        # Replace: swap atomically where the OS can, so a reader always sees a
        # complete checkpoint; else move the old one aside first (it stays complete).
        if exchange(tmp, final):
            remove_tree(tmp)  # now the old checkpoint; a reader of it notices and reads again
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
        remove_tree(aside)

    def abort(self, error: BaseException) -> None:
        if self.owner:
            remove_tree(self.tmp)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _local_files(root: pathlib.Path) -> dict[str, int]:
    found: dict[str, int] = {}
    pending = [("", str(root))]
    while pending:
        rel, where = pending.pop()
        with os.scandir(where) as entries:
            for entry in entries:
                key = f"{rel}{entry.name}"
                if entry.is_dir(follow_symlinks=False):
                    pending.append((key + "/", entry.path))
                else:
                    found[key] = entry.stat(follow_symlinks=False).st_size
    return found


def _unsafe(leaf: StoredLeaf, where: pathlib.Path) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"Leaf {leaf.path!r}: {where} is a symlink or special file, not the plain files eqxckpt writes. "
        "Refusing to read it (it could point outside the checkpoint). Do not trust this checkpoint.",
        path=leaf.path,
    )


# --- object stores ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ObjectStorage(Storage):
    """A checkpoint under a prefix of an object store (or TensorStore's memory store)."""

    def sub(self, name: str) -> "ObjectStorage":
        return ObjectStorage(self.child(name))

    def argument(self) -> dict[str, Any]:
        return dict(self.kvstore)

    def __str__(self) -> str:
        spec = self.kvstore
        return f"{spec['driver']}://{spec.get('bucket', '')}/{spec.get('path', '')}".replace(":///", "://")

    def read_manifest(self) -> tuple[Manifest, Pin]:
        try:
            store = self.open_kvstore()
            result = _read_bounded(store, MANIFEST_NAME, MAX_MANIFEST_BYTES)
            if result.state == "value":
                return parse_manifest(bytes(result.value), str(self)), StorePin(self, result.stamp.generation)
            _, lease = read_lease(store)
            listed = store.list().result()
        except ValueError as e:
            if not is_storage_error(e):
                raise
            if str(e).startswith("NOT_FOUND"):
                raise CheckpointNotFoundError(
                    f"No checkpoint at {self}: {reason(e)} (is the bucket's name right?)"
                ) from None
            raise CheckpointError(
                f"Cannot read {self}: {reason(e)}. Check the endpoint (AWS_ENDPOINT_URL), the network and the "
                "credentials."
            ) from None
        if lease is not None and not is_stale(lease) and lease.get("purpose") != "save":
            raise CheckpointNotFoundError(f"No checkpoint at {self}: it is being deleted ({describe_lease(lease)}).")
        if lease is not None and not is_stale(lease):
            raise IncompleteCheckpointError(
                f"No committed checkpoint at {self} right now: a save is writing it, or was killed less than "
                f"its lease's timeout ago ({describe_lease(lease)}). Load it again once that save has finished, or "
                "load an earlier checkpoint."
            )
        if listed:
            raise IncompleteCheckpointError(
                f"{self} has data but no {MANIFEST_NAME}: no save committed a checkpoint there (one was "
                "interrupted, or this is not an eqxckpt checkpoint). Load an earlier checkpoint, or save elsewhere."
            )
        raise CheckpointNotFoundError(f"No checkpoint at {self}.")

    def read_leaf_metadata(self, leaf: StoredLeaf) -> ts.Future:
        # Object stores cannot cap a read without a second request: the size is
        # checked before parsing, so memory stays bounded by the file's size.
        return self.open_kvstore().read(f"{leaf.path}/zarr.json")

    def begin_save(self, paths: list[str], overwrite: bool) -> "ObjectStaging":
        """Take the lease on this place and clear what the new save replaces.

        Only what eqxckpt can prove it wrote is ever deleted: the keys of the
        leaves a committed manifest lists (and those of an abandoned save's lease).
        """
        warn_if_not_atomic(self.kvstore)
        store = self.open_kvstore()
        reclaim(store)
        self._check_place(store, paths, overwrite)  # refuse before writing anything, if it must be refused
        current, doc = read_lease(store)
        if current.state == "value":
            if doc is None:
                raise CheckpointExistsError(
                    f"{self} holds an object named {LEASE_NAME} that eqxckpt did not write; refusing to save there."
                )
            raise CheckpointBusyError(
                f"Another save or deletion holds {self} ({describe_lease(doc)}). Nothing was changed; wait for it, "
                "or save elsewhere. If that process died, the place frees itself once the lease times out."
            )
        # Created only if still absent; then everything is decided again under the
        # lease: no other eqxckpt process can commit, replace or delete here meanwhile.
        lease = Lease(store, "save", paths, current.stamp.generation)
        try:
            old_paths = self._check_place(store, paths, overwrite)
            if old_paths is not None:
                lease.extend(old_paths)  # so that a crash from here on leaves them to cleanup, listed
                lease.replaces = True
                uncommit(store, old_paths)
        except BaseException:
            lease.release()
            raise
        lease.start_heartbeat()
        return ObjectStaging(self, lease, paths)

    def _check_place(self, store: ts.KvStore, paths: list[str], overwrite: bool) -> list[str] | None:
        """Whether a save may write here; the leaf paths of the committed
        checkpoint it replaces (None if there is none).

        Refused: a committed checkpoint without ``overwrite``, one whose manifest is
        damaged (which keys are its cannot be told), a place without a checkpoint
        that holds anything else, and foreign keys under one of the new leaf paths.
        """
        committed = store.read(MANIFEST_NAME).result()
        old_paths: list[str] = []
        if committed.state == "value":
            if not overwrite:
                raise CheckpointExistsError(
                    f"A checkpoint already exists at {self}. Pass overwrite=True to replace it."
                )
            try:
                old = parse_manifest(bytes(committed.value), str(self))
            except ManifestError as e:
                raise CheckpointExistsError(
                    f"The checkpoint at {self} has a damaged manifest, so eqxckpt cannot tell which keys are its; "
                    f"refusing to replace it ({e}). Remove it yourself or save elsewhere."
                ) from None
            old_paths = old.stored_paths()
        keys = [k.decode("utf-8", "replace") for k in store.list().result()]
        foreign = sorted(set(keys) - _owned_keys(keys, set(old_paths)) - {MANIFEST_NAME, LEASE_NAME})
        if foreign and committed.state != "value":
            raise CheckpointExistsError(
                f"{self} is not an eqxckpt checkpoint: it holds data that eqxckpt did not write (e.g. "
                f"{foreign[0]!r}, {len(foreign)} keys); refusing to save there. Choose another path."
            )
        for path in set(paths) - set(old_paths):
            at = bisect.bisect_left(foreign, path + "/")
            if at < len(foreign) and foreign[at].startswith(path + "/"):
                raise CheckpointExistsError(
                    f"{self} holds data that eqxckpt did not write at leaf {path!r} ({foreign[at]!r}); "
                    "refusing to save over it. Choose another path."
                )
        return old_paths if committed.state == "value" else None

    def join_save(self, where: str) -> "ObjectStaging":
        return ObjectStaging(self, None, [])

    def _groups(self) -> dict[str, set[str]]:
        groups: dict[str, set[str]] = {}
        for key in self.open_kvstore().list().result():
            head, _, rest = key.decode("utf-8", "replace").partition("/")
            groups.setdefault(head, set()).add(rest)
        return groups

    def entries(self) -> list[tuple[str, str]]:
        # An entry with a lease and no manifest is a save or deletion in progress, or cleanup's to finish.
        return [
            (head, "committed" if MANIFEST_NAME in rests else "busy" if LEASE_NAME in rests else "other")
            for head, rests in sorted(self._groups().items())
        ]

    def clean_leftovers(self) -> None:
        for head, rests in self._groups().items():
            if LEASE_NAME in rests:
                reclaim(self.sub(head).open_kvstore())

    def delete(self) -> bool:
        store = self.open_kvstore()
        committed = store.read(MANIFEST_NAME).result()
        if committed.state != "value":
            return True
        try:
            paths = parse_manifest(bytes(committed.value), str(self)).stored_paths()
        except ManifestError:
            return True  # damaged: eqxckpt cannot tell which keys are its, so it leaves them
        current, _ = read_lease(store)
        if current.state == "value":
            return False  # another process is deleting it or saving there: try later
        try:
            lease = Lease(store, "delete", paths, current.stamp.generation)  # only if still absent
        except CheckpointBusyError:
            return False
        uncommit(store, paths)
        lease.release()
        return True


class ObjectStaging(Staging):
    """A save straight into the checkpoint's prefix, under a lease; the manifest, written last, commits."""

    def __init__(self, storage: ObjectStorage, lease: Lease | None, paths: list[str]):
        self.storage = storage
        self.lease = lease
        self.paths = paths

    def commit(self, manifest: Manifest, expected: dict[str, int]) -> None:
        assert self.lease is not None
        self.lease.check()
        store = self.storage.open_kvstore()
        _check_complete({k.decode("utf-8", "replace"): -1 for k in store.list().result()}, expected)
        absent = store.read(MANIFEST_NAME).result()
        if (
            absent.state == "value"
            or not store.write(MANIFEST_NAME, manifest.to_bytes(), if_equal=absent.stamp.generation).result().generation
        ):
            raise CheckpointBusyError(
                f"Another process committed a checkpoint at {self.storage} during this save. {NOTHING_COMMITTED}"
            )
        self.lease.release()

    def abort(self, error: BaseException) -> None:
        """Remove what a failed save wrote, but only while it still holds the lease:
        a save that lost it may no longer touch what another process now owns."""
        lease = self.lease
        if lease is None:
            return
        if lease.replaces:
            error.add_note(
                f"The checkpoint this save was replacing at {self.storage} had already been removed: object "
                "stores cannot replace a checkpoint atomically. Save it again."
            )
        lease.stop_heartbeat()
        try:
            lease.check()
        except CheckpointError:
            return
        try:
            delete_leaf_keys(lease.store, self.paths)
            lease.release()
        except Exception:  # noqa: BLE001 - the lease stays and times out; cleanup then finishes this
            pass


def _owned_keys(keys: list[str], paths: set[str]) -> set[str]:
    """The keys eqxckpt wrote for the leaves at ``paths`` (their zarr.json and chunks)."""
    owned = set()
    for key in keys:
        parts = key.split("/")
        for i, part in enumerate(parts):
            if (part == "c" or (part == "zarr.json" and i == len(parts) - 1)) and "/".join(parts[:i]) in paths:
                owned.add(key)
                break
    return owned


def _read_bounded(store: ts.KvStore, key: str, cap: int) -> Any:
    """Read ``key``, downloading at most ``cap + 1`` bytes of it (then the caller refuses it).

    A ranged read past the end of a smaller value fails, so a small value
    (the usual case) is read again whole; a huge one is never downloaded.
    """
    try:
        return store.read(key, byte_range=slice(0, cap + 1)).result()
    except ValueError as e:
        if not str(e).startswith("OUT_OF_RANGE"):
            raise
    return store.read(key).result()


# --- paths from users ------------------------------------------------------------------------


def resolve(path: CheckpointPath | Storage) -> Storage:
    """Turn a user's ``path`` argument into a `Storage`.

    Accepts a local path, a ``file://``, ``memory://``, ``s3://`` or ``gs://``
    URL, or a TensorStore kvstore spec dict (for custom endpoints).
    """
    if isinstance(path, Storage):
        return path
    if isinstance(path, dict):
        spec = dict(path)
        if "driver" not in spec:
            raise CheckpointError(f"A kvstore spec needs a 'driver' member, got {path!r}.")
        spec["path"] = _as_dir(spec.get("path", ""))
        if spec["driver"] == "file":
            return LocalStorage.at(pathlib.Path(spec["path"]).absolute())
        return ObjectStorage(spec)
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise TypeError(f"path must be a str, os.PathLike or kvstore spec dict, got {path!r}.")
    scheme, sep, rest = path.partition("://")
    if not sep:
        return LocalStorage.at(pathlib.Path(path).expanduser().absolute())
    if scheme == "file":
        return LocalStorage.at(pathlib.Path(rest).absolute())
    if scheme == "memory":
        return ObjectStorage({"driver": "memory", "path": _as_dir(rest)})
    if scheme in ("s3", "gs"):
        bucket, _, prefix = rest.partition("/")
        spec: dict[str, Any] = {"driver": "s3" if scheme == "s3" else "gcs", "bucket": bucket, "path": _as_dir(prefix)}
        if scheme == "s3":
            spec.update(_s3_environment())
        return ObjectStorage(spec)
    raise CheckpointError(
        f"Unsupported URL scheme {scheme!r} in {path!r}: use a local path, file://, memory://, s3:// or gs://, "
        "or a kvstore spec dict."
    )


def _s3_environment() -> dict[str, Any]:
    """The S3 settings AWS tools take from the environment, for ``s3://`` URLs.

    ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` point at an S3-compatible
    server; with ``AWS_ACCESS_KEY_ID`` set, credentials come from the
    environment only (never from a cloud metadata service).
    """
    spec: dict[str, Any] = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        spec["aws_credentials"] = {"type": "environment"}
    return spec


def _as_dir(prefix: str) -> str:
    prefix = prefix.strip("/") if not prefix.startswith("/") else prefix.rstrip("/")
    return prefix + "/" if prefix else ""
