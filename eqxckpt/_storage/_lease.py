"""Who may create, commit, clean up and delete what, with many processes on one place.

Several processes may use one directory at once: a trainer saving, an
evaluator polling a `CheckpointManager` and loading, a second manager, a
process overwriting a checkpoint that another one is loading. The protocol:

**Local filesystems.** Ownership and liveness are advisory locks (``flock``)
on directories, which the kernel releases when the holder dies, so a lock
that can be taken proves that nobody holds it: no clocks, no guessing.

- A save writes into a hidden sibling ``.NAME.eqxckpt-tmp-<hex>``. Its writer
  holds a shared lock on that directory from the moment it is created until
  the commit (in a multi-process save, every process holds one while it
  writes). Before it commits, the writer checks that every leaf's
  ``zarr.json`` and every chunk file is present with the size it must have;
  then it writes the manifest and renames the directory into place (or swaps
  it with the checkpoint it replaces, atomically).
- Cleanup (a `CheckpointManager` opening a directory, a `save` to a path)
  removes a hidden sibling only if its name is one eqxckpt makes (a reserved
  pattern; nothing else is ever touched) and it can take an exclusive lock
  on it without waiting: then no live process is writing or deleting it.
- A load holds a shared lock on the checkpoint directory while it reads, and
  deleting a committed checkpoint (retention) takes an exclusive lock first:
  a checkpoint being read is not deleted (the manager retries later). A
  deleter renames the directory to ``.NAME.eqxckpt-deleting-<hex>`` before
  removing anything, so a half-deleted checkpoint is never visible.
- A load also checks, after reading, that the path still names the directory
  it read the manifest from (it holds that directory open, so the identity
  cannot be reused): if a save replaced it meanwhile, it reads again (or
  raises `CheckpointChangedError`), so it never returns a mix.

Where ``flock`` is unavailable, saves still work, and cleanup removes nothing.

**Object stores** (S3, GCS, memory) have neither rename nor locks, but they
have conditional writes. There:

- No two saves ever write one key: each writes its arrays under a prefix of
  its own, ``%arrays.<hex>/``, which its manifest names. A writer paused at any
  instant can only ever land uploads in its own prefix.
- A lease object, ``eqxckpt.lease.json``, created only if absent, says who holds
  the place and what it is doing (``action``: writing a save, committing it,
  deleting a checkpoint). Its holder renews it and changes it only by writes
  on condition that it is still the lease it wrote.
- Commit: check the prefix is complete, write the manifest into it
  (``eqxckpt.commit.json``), change the lease's action to ``commit``
  (conditional: a writer that lost its lease stops here), then write the
  manifest at the root on condition that it is still the one the save began
  with. An overwrite is one write: readers see the old checkpoint or the new.
- A lease whose heartbeat is older than its timeout is abandoned: cleanup
  takes it over (a conditional write, so its holder can no longer commit) and
  finishes its action: deletes a save's prefix, rolls a commit forward from
  the manifest staged in its prefix (then retires the prefix it replaced,
  which the commit's lease names), completes a deletion. Clocks only decide
  when a lease looks abandoned; one taken over too early makes its live
  holder's next conditional write fail.
- A prefix its checkpoint no longer names (replaced or deleted) is marked
  ``%retired`` before anything of it is deleted. Cleanup deletes a prefix only
  if an abandoned lease at its place names it or it is so marked: any other
  prefix that neither the manifest nor the lease names (a copy of a
  checkpoint in progress, its prefix copied first; a user's files) is left alone.
- A load remembers the manifest's generation (its ETag) and checks it after
  reading; each manifest holds a unique ``save_id``, so generations differ.
- An incremental save may refer to unchanged leaves in a sibling checkpoint's
  prefix instead of writing them. It first writes a hold into that prefix
  (``%holds/<its entry>/<its prefix>``), then checks the prefix is neither
  doomed nor gone. A deleter deletes a prefix only if no hold in it is live
  (its save holds its lease, or its checkpoint's manifest names it), after
  marking it ``%doomed`` and finding no live hold again; it deletes the doom
  mark last. So a save that passed its check is always seen by the deleter.

Nothing else is ever deleted, on any backend.
"""

import errno
import fcntl
import json
import math
import os
import pathlib
import re
import shutil
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

import tensorstore as ts

from .._errors import CheckpointBusyError, CheckpointChangedError, CheckpointWriteError, ManifestError
from .._manifest import MAX_MANIFEST_BYTES, check_checksum, parse_json_object, parse_manifest
from .._paths import (
    COMMIT_NAME,
    DOOMED_NAME,
    GROUP_METADATA,
    HOLDS_NAME,
    LEASE_NAME,
    MANIFEST_NAME,
    RETIRED_NAME,
    group_file,
    group_locations,
    is_arrays_name,
    is_entry_name,
    validate_path,
)
from ._fs import fsync_path, hidden_owner, hidden_sibling

# --- local filesystems: advisory locks on directories --------------------------------


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
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


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
        except OSError:
            return tmp, f  # no locks here: cleanup cannot tell either, and removes nothing
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


def delete_local(final: pathlib.Path) -> bool:
    """Delete a committed checkpoint, unless a reader holds it.

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
        if not remove_tree(aside):
            raise OSError(errno.EACCES, f"{aside} could not be removed whole (uncommitted, it is never loaded)")
    return True


def _check_removable(root: pathlib.Path) -> None:
    """Raise `PermissionError` naming the first directory of ``root`` whose entries this
    process cannot remove (or ``root``'s parent, which must let it be renamed)."""
    for where in [root.parent, root] + [pathlib.Path(d) for d, _, _ in os.walk(root) if d != str(root)]:
        if not os.access(where, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "Permission denied: cannot remove what it holds", str(where))


# --- object stores: a lease object, and compare-and-swap ----------------------------------

LEASE_FORMAT = "eqxckpt-lease"
# What a lease's holder is doing: writing a save's arrays, committing that save, or
# deleting a checkpoint. A lease with no action was written by eqxckpt before
# saves had prefixes of their own: its "paths" are what its save wrote.
ACTIONS = ("save", "commit", "delete")
LOST = (
    "This save lost its lease (its heartbeat stopped for longer than the lease timeout, and another "
    "process took over the place). Nothing was committed; save again."
)


def lease_timeout() -> float:
    return float(os.environ.get("EQXCKPT_LEASE_TIMEOUT_S", "600"))


def parse_lease(raw: bytes) -> dict | None:
    """A lease document, or None if ``raw`` is not one eqxckpt wrote."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != LEASE_FORMAT:
        return None
    paths, heartbeat, timeout = doc.get("paths"), doc.get("heartbeat_unix"), doc.get("timeout_s")
    arrays, base = doc.setdefault("arrays", []), doc.setdefault("base", "")
    if not (isinstance(paths, list) and all(isinstance(p, str) for p in paths)):
        return None
    if not (isinstance(arrays, list) and all(is_arrays_name(a) for a in arrays) and _is_hex(base)):
        return None
    # A commit: the prefix of the checkpoint it replaces, retired once it has committed.
    retire = doc.setdefault("retire", [])
    if not (isinstance(retire, list) and len(retire) <= 1 and all(is_arrays_name(a) for a in retire)):
        return None
    action = doc.setdefault("action", None)
    # A save or its commit names exactly its own prefix; a deletion, the one it deletes (none
    # for a checkpoint from before prefixes); a lease from before prefixes, none.
    if action not in (*ACTIONS, None) or len(arrays) > 1 or (action in ("save", "commit") and len(arrays) != 1):
        return None
    # A NaN or infinite heartbeat (Python's JSON reads both) would never go stale.
    if not (_finite(heartbeat) and isinstance(timeout, (int, float)) and _finite(timeout) and timeout > 0):
        return None
    try:
        for path in paths:
            validate_path(path, what="lease path")
    except ManifestError:
        return None
    return doc


def _is_hex(text: Any) -> bool:
    try:
        bytes.fromhex(text)
    except (TypeError, ValueError):
        return False
    return True


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_stale(doc: dict, now: float | None = None) -> bool:
    return (time.time() if now is None else now) > doc["heartbeat_unix"] + doc["timeout_s"]


def describe_lease(doc: dict) -> str:
    age = time.time() - doc["heartbeat_unix"]
    return (
        f"{doc.get('purpose', 'save')} by {doc.get('host', '?')} pid {doc.get('pid', '?')}, "
        f"last heartbeat {age:.0f} s ago, abandoned after {doc['timeout_s']:.0f} s"
    )


def delete_leaf_keys(store: ts.KvStore, paths: list[str]) -> None:
    """Delete what eqxckpt writes for each leaf (its ``zarr.json`` and chunk keys), then
    the zarr group files above them that hold exactly what eqxckpt writes; nothing else.
    (Checkpoints written before saves had prefixes of their own keep their arrays here.)"""
    if not paths:
        return
    futures = []
    for path in paths:
        futures.append(store.delete_range(ts.KvStore.KeyRange(f"{path}/zarr.json", f"{path}/zarr.json\0")))
        futures.append(store.delete_range(ts.KvStore.KeyRange(f"{path}/c", f"{path}/c\0")))  # a 0-d array's chunk
        futures.append(store.delete_range(ts.KvStore.KeyRange(f"{path}/c/", f"{path}/c0")))
    for future in futures:
        future.result()
    keys = [group_file(group) for group in group_locations(paths)]
    reads = [(key, read_exact(store, key, len(GROUP_METADATA))) for key in keys]
    deletes = []
    for key, read in reads:
        try:
            found = read.result()
        except SizeError:
            continue  # not what eqxckpt writes
        if found.state == "value" and bytes(found.value) == GROUP_METADATA:  # unchanged since eqxckpt wrote it
            deletes.append(store.write(key, None, if_equal=found.stamp.generation))
    for future in deletes:
        try:
            future.result()
        except ValueError:  # changed meanwhile (by someone else): not ours to delete any more
            pass


def delete_arrays(store: ts.KvStore, names: list[str]) -> None:
    """Delete saves' own prefixes (``%arrays.<hex>/``): keys no other save ever writes.
    Only for prefixes that were never committed (no save refers to those); committed
    ones are deleted by `delete_unheld`."""
    for future in [store.delete_range(ts.KvStore.KeyRange(f"{name}/", f"{name}0")) for name in names]:
        future.result()


# -- holds: incremental saves referring to a sibling checkpoint's prefix ------------------


def run_store(store: ts.KvStore) -> tuple[ts.KvStore, str] | None:
    """The directory above a checkpoint's store, and the checkpoint's name in it; None
    for a checkpoint at the root of its store (it has no siblings to refer to it)."""
    head, _, name = store.path.rstrip("/").rpartition("/")
    if not name or not is_entry_name(name):
        return None
    run = store.copy()
    run.path = f"{head}/" if head else ""
    return run, name


def take_hold(run: ts.KvStore, entry: str, arrays: str, holder: tuple[str, str]) -> bool:
    """Record that the save writing ``holder`` (its entry, its prefix) refers to leaves in
    ``entry``'s prefix ``arrays``; True if it may: that prefix is neither doomed nor gone.

    The order makes this safe against `delete_unheld`: the hold is written before the
    doom mark is read, and the deleter writes the doom mark before looking for holds and
    deletes it after everything else, so either this save sees the mark (or the prefix
    gone) or the deleter sees this hold.
    """
    prefix = f"{entry}/{arrays}"
    key = f"{prefix}/{HOLDS_NAME}/{holder[0]}/{holder[1]}"
    run.write(key, b"").result()
    if not exists(run, f"{prefix}/{DOOMED_NAME}") and exists(run, f"{prefix}/{COMMIT_NAME}"):
        return True
    release_hold(run, entry, arrays, holder)
    return False


def release_hold(run: ts.KvStore, entry: str, arrays: str, holder: tuple[str, str]) -> None:
    """Remove a hold a save took but will not use (else it would keep the prefix while that save's checkpoint lives)."""
    run.write(f"{entry}/{arrays}/{HOLDS_NAME}/{holder[0]}/{holder[1]}", None).result()


def _hold_is_live(run: ts.KvStore, holder: str) -> bool:
    """Whether the save a hold names (``<entry>/<prefix>``) may refer to the prefix it is in:
    its lease names that prefix (the save is in flight, or being finished or deleted), or
    its checkpoint's manifest does. Read in that order: a save holds its lease until its
    manifest is written, so a save seen in neither has ended without committing, or its
    checkpoint was replaced or deleted: the hold can never be live again."""
    entry, _, arrays = holder.partition("/")
    if not is_entry_name(entry) or not is_arrays_name(arrays):
        return False  # not a hold eqxckpt writes: it keeps nothing
    store = run.copy()
    store.path = f"{run.path}{entry}/"
    return _named(store, arrays)


def _named(store: ts.KvStore, arrays: str) -> bool:
    """Whether the checkpoint at ``store`` may still use its prefix ``arrays``: its lease or
    its manifest names it, read in that order; one eqxckpt cannot read keeps it (nothing
    is proven)."""
    current, doc = read_lease(store)
    if current.state == "value" and (doc is None or arrays in doc["arrays"]):
        return True
    named = committed_arrays(store)
    return named is None or named == arrays


def _holds_live(store: ts.KvStore, run: ts.KvStore, name: str) -> bool:
    """Whether any hold in the prefix ``name`` is live; holds found dead are removed."""
    start = f"{name}/{HOLDS_NAME}/"
    keys = [key.decode("utf-8", "replace") for key in store.list(ts.KvStore.KeyRange(start, start[:-1] + "0")).result()]
    dead, live = [], False
    for key in keys:
        if _hold_is_live(run, key[len(start) :]):
            live = True
            break
        dead.append(key)
    for removed in [store.write(key, None) for key in dead]:  # together, not one request at a time
        removed.result()
    return live


def collect_prefix(store: ts.KvStore, name: str) -> bool:
    """Delete the prefix ``name`` of the checkpoint at ``store`` if neither its lease nor its
    manifest names it (a retired prefix) and no live hold is in it; True if deleted. Run
    after deleting a checkpoint that referred to it, without listing the whole checkpoint."""
    return not _named(store, name) and bool(delete_unheld(store, [name]))


def delete_unheld(store: ts.KvStore, names: list[str]) -> list[str]:
    """Retire the committed prefixes ``names`` of the checkpoint at ``store`` (which it no
    longer names), then delete those that no live save or checkpoint refers to; returns
    those deleted. A prefix with a live hold is left whole, marked retired, to be
    collected when its last holder is gone (`collect_prefix`, `collect_garbage`)."""
    for marked in [store.write(f"{name}/{RETIRED_NAME}", b"") for name in names]:
        marked.result()  # first: whatever stops this, the prefix is provably garbage now
    place = run_store(store)
    if place is None:
        delete_arrays(store, names)
        return list(names)
    run, _ = place
    deleted = []
    for name in names:
        if _holds_live(store, run, name):
            continue
        store.write(f"{name}/{DOOMED_NAME}", b"").result()
        if _holds_live(store, run, name):
            continue  # a save took a hold meanwhile and may use it; the prefix stays doomed
        doomed, retired = f"{name}/{DOOMED_NAME}", f"{name}/{RETIRED_NAME}"  # doomed < retired
        store.delete_range(ts.KvStore.KeyRange(f"{name}/", doomed)).result()
        store.delete_range(ts.KvStore.KeyRange(doomed + "\0", retired)).result()
        store.delete_range(ts.KvStore.KeyRange(retired + "\0", f"{name}0")).result()
        store.write(retired, None).result()  # until now, listings see a retired prefix
        store.write(doomed, None).result()  # last: until now a save that looks sees it doomed
        deleted.append(name)
    return deleted


_warned_endpoints: set[str] = set()


def warn_if_not_atomic(kvstore: dict) -> None:
    """Leases rely on the store's conditional writes. TensorStore sends real ones
    (``If-None-Match``/``If-Match``) to AWS S3; for other S3 endpoints it
    emulates them with a check then a write, which two writers can both pass,
    unless ``TENSORSTORE_S3_USE_CONDITIONAL_WRITE=1`` is set."""
    if kvstore.get("driver") != "s3":
        return
    endpoint = str(kvstore.get("endpoint", ""))
    host = endpoint.split("://")[-1].split("/")[0]
    atomic = (
        not endpoint
        or host.endswith("amazonaws.com")
        or os.environ.get("TENSORSTORE_S3_USE_CONDITIONAL_WRITE", "").lower() in ("1", "true", "yes")
    )
    if not atomic and endpoint not in _warned_endpoints:
        _warned_endpoints.add(endpoint)
        warnings.warn(
            f"Saving to the S3-compatible endpoint {endpoint} without atomic conditional writes: two processes "
            "saving to one place at the same moment could both proceed. If the server supports If-Match and "
            "If-None-Match (MinIO, Ceph, moto do), set TENSORSTORE_S3_USE_CONDITIONAL_WRITE=1.",
            stacklevel=4,
        )


class Lease:
    """This process's lease on an object-store checkpoint: taken, changed, renewed and
    released, each by a write on condition that the lease is still the one it wrote."""

    def __init__(
        self,
        store: ts.KvStore,
        purpose: str,
        seen: bytes,
        *,
        action: str | None,
        arrays: Sequence[str] = (),
        paths: Sequence[str] = (),
        base: bytes = b"",
        retire: Sequence[str] = (),
    ):
        """Take the lease, on condition that the lease object is still what was
        read (``seen``: the generation of a read that found none, or of the
        abandoned lease being taken over)."""
        self.store = store
        self.save_id = uuid.uuid4().hex
        self.timeout = lease_timeout()
        self.doc = {
            "format": LEASE_FORMAT,
            "purpose": purpose,
            "action": action,
            "save_id": self.save_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_unix": time.time(),
            "heartbeat_unix": time.time(),
            "timeout_s": self.timeout,
            "arrays": list(arrays),
            "paths": sorted(set(paths)),
            "base": base.hex(),
            "retire": list(retire),
        }
        generation = self._write(seen)
        if generation is None:
            raise CheckpointBusyError(
                "Another process took the lease on this checkpoint first; it is saving or "
                "deleting there now. Nothing was changed."
            )
        self.generation: bytes = generation
        self.lost = False
        self._lock = threading.Lock()  # one conditional write at a time: the heartbeat's or the owner's
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self, if_equal: bytes) -> bytes | None:
        self.doc["heartbeat_unix"] = time.time()
        stamp = self.store.write(LEASE_NAME, json.dumps(self.doc).encode(), if_equal=if_equal).result()
        return stamp.generation or None  # empty: the condition failed

    def update(self, **fields: Any) -> None:
        """Change the lease's document, on condition that it is still this process's
        (raises `CheckpointBusyError` if another process took it over)."""
        with self._lock:
            if not self.lost:
                self.doc.update(fields)
                generation = self._write(self.generation)
                if generation is not None:
                    self.generation = generation
                    return
            self.lost = True
        raise CheckpointBusyError(LOST)

    def start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._stop.wait(self.timeout / 4):
                try:
                    self.update()
                except CheckpointBusyError:
                    return
                except Exception:  # noqa: BLE001 - a transient error: try again at the next beat
                    continue

        self._thread = threading.Thread(target=beat, name="eqxckpt-lease", daemon=True)
        self._thread.start()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def check(self) -> None:
        """Raise unless this process still holds the lease."""
        _, doc = read_lease(self.store)
        if self.lost or doc is None or doc.get("save_id") != self.save_id:
            self.lost = True
            raise CheckpointBusyError(LOST)

    def release(self) -> None:
        """Stop renewing and delete the lease, if it is still ours."""
        self.stop_heartbeat()
        if not self.lost:
            self.store.write(LEASE_NAME, None, if_equal=self.generation).result()


def read_lease(store: ts.KvStore) -> tuple[Any, dict | None]:
    """The lease at a checkpoint's root: (read result, its document or None)."""
    # Bounded: a lease lists at most a manifest's leaf paths; a huge object there is not one.
    current = read_bounded(store, LEASE_NAME, MAX_MANIFEST_BYTES)
    return current, (parse_lease(bytes(current.value)) if current.state == "value" else None)


def reclaim(store: ts.KvStore) -> str:
    """Finish what an abandoned lease's holder was doing, at an object-store checkpoint's root.

    Returns ``"none"`` (no lease), ``"alive"`` (a live lease, or an object by
    that name eqxckpt did not write: left alone), or ``"reclaimed"``.

    The abandoned lease is first taken over with a conditional write, so that
    its holder, should it wake up, can neither renew it nor commit. Then its
    action is finished: a save's arrays are deleted (it never committed: its
    last conditional write before the commit would have failed), a commit is
    rolled forward from the manifest it left in its prefix, a deletion completes.
    """
    current, doc = read_lease(store)
    if current.state != "value":
        return "none"
    if doc is None or not is_stale(doc):
        return "alive"
    try:
        fields = {k: doc[k] for k in ("arrays", "paths", "retire")}
        lease = Lease(
            store, "reclaim", current.stamp.generation, action=doc["action"], base=bytes.fromhex(doc["base"]), **fields
        )
    except CheckpointBusyError:
        return "alive"  # another process renewed or reclaimed it first
    finish(store, lease.doc)
    lease.release()
    collect_garbage(store)
    return "reclaimed"


def finish(store: ts.KvStore, doc: dict) -> None:
    """Complete the action a lease records (its holder stopped, or is finishing it)."""
    action, arrays, paths, base = doc["action"], doc["arrays"], doc["paths"], bytes.fromhex(doc["base"])
    if action == "save":
        delete_arrays(store, arrays)
    elif action == "commit":
        [name] = arrays
        if roll_forward(store, name, base):
            delete_leaf_keys(store, paths)  # what the committed save replaced, if written before prefixes
            delete_unheld(store, doc["retire"])  # and the prefix of the one it replaced
        else:
            delete_arrays(store, arrays)  # its manifest is not the base any more: it can never commit
    elif action == "delete":
        top = stat(store, MANIFEST_NAME)
        if top.state == "value" and top.stamp.generation == base:
            store.write(MANIFEST_NAME, None, if_equal=base).result()  # uncommitted first: no reader sees a part
        delete_unheld(store, arrays)
        delete_leaf_keys(store, paths)
    elif stat(store, MANIFEST_NAME).state != "value":  # a save by an eqxckpt without prefixes
        delete_leaf_keys(store, paths)


def roll_forward(store: ts.KvStore, name: str, base: bytes) -> bool:
    """Commit the save whose arrays are at ``name``, on condition that the manifest is
    still ``base``; True if that save's manifest is the committed one now."""
    staged = read_bounded(store, f"{name}/{COMMIT_NAME}", MAX_MANIFEST_BYTES)
    if staged.state != "value":
        return False
    raw = bytes(staged.value)
    try:
        if parse_manifest(raw, f"{name}/{COMMIT_NAME}").arrays != name:
            return False
    except ManifestError:
        return False  # not what a save stages: never made the checkpoint
    return write_manifest(store, raw, base)


def write_manifest(store: ts.KvStore, raw: bytes, base: bytes) -> bool:
    """Write the manifest ``raw`` (the commit) on condition that the manifest is still
    ``base``; True if ``raw`` is the committed manifest now (written here, or before)."""
    if store.write(MANIFEST_NAME, raw, if_equal=base).result().generation:
        return True
    # The condition failed: done already (by the save itself, or by a cleanup), or not at all.
    top = read_bounded(store, MANIFEST_NAME, MAX_MANIFEST_BYTES)
    return top.state == "value" and bytes(top.value) == raw


class SizeError(Exception):
    """A value is not of the size asked for: ``size`` is what it holds (None: more)."""

    def __init__(self, size: int | None):
        super().__init__(size)
        self.size = size


# The size a store reports when it refuses a byte range past a value's end ("... total
# size N" from S3 and Cloud Storage, "... of size N" from the memory store). A range
# refused without one (S3's and Cloud Storage's 416) starts past the end of an empty value.
_REFUSED_SIZE = re.compile(r"\bsize (\d+)\b")


def _refused(error: BaseException) -> bool:
    return isinstance(error, ValueError) and str(error).startswith("OUT_OF_RANGE")


def read_exact(store: ts.KvStore, key: str, size: int) -> ts.Future:
    """Start reading ``key`` if it holds exactly ``size`` bytes, downloading no more than that.

    Two ranged reads at once: ``[0, size)`` (refused if the value is smaller) and the
    one byte after it (found only if it is larger). The future's result is the read
    result (state ``missing`` if absent); its exception a `SizeError` if the value is
    of another size.
    """
    promise, future = ts.Promise.new()
    data = store.read(key, byte_range=slice(0, size))
    beyond = store.read(key, byte_range=slice(size, size + 1))

    def settle(_: ts.Future) -> None:  # once both are done
        try:
            try:
                result = data.result()
            except ValueError as e:
                if not _refused(e):
                    raise
                match = _REFUSED_SIZE.search(str(e))
                raise SizeError(int(match[1]) if match else 0) from None
            if result.state == "value":
                try:
                    if beyond.result().state == "value":
                        raise SizeError(None)
                except ValueError as e:
                    if not _refused(e):
                        raise
            promise.set_result(result)
        except Exception as e:  # noqa: BLE001 - handed to the reader
            promise.set_exception(e)

    data.add_done_callback(lambda _: beyond.add_done_callback(settle))
    return future


def read_bounded_future(store: ts.KvStore, key: str, cap: int, attempts: int = 4) -> ts.Future:
    """Start reading ``key``, downloading at most ``cap + 1`` bytes of it (more: the
    caller refuses it); the future's result is the read result.

    A ranged read past the end of a smaller value (the usual case) is refused with its
    size, which is then read exactly (`read_exact`): no read ever downloads more than it
    asked for, even if the value is replaced in between (then it is read again).
    """
    promise, future = ts.Promise.new()

    def start(left: int) -> None:
        first = store.read(key, byte_range=slice(0, cap + 1))

        def on_first(done: ts.Future) -> None:
            try:
                promise.set_result(done.result())
                return
            except ValueError as e:
                if not _refused(e):
                    promise.set_exception(e)
                    return
                match = _REFUSED_SIZE.search(str(e))
            except Exception as e:  # noqa: BLE001 - handed to the reader
                promise.set_exception(e)
                return
            read_exact(store, key, int(match[1]) if match else 0).add_done_callback(on_exact)

        def on_exact(done: ts.Future) -> None:
            try:
                promise.set_result(done.result())
            except SizeError:
                if left > 1:
                    start(left - 1)  # replaced in between: read it again
                else:
                    promise.set_exception(
                        CheckpointChangedError(f"{key} changed size {attempts} times while it was read; try again.")
                    )
            except Exception as e:  # noqa: BLE001 - handed to the reader
                promise.set_exception(e)

        first.add_done_callback(on_first)

    start(attempts)
    return future


def read_bounded(store: ts.KvStore, key: str, cap: int) -> Any:
    """Read ``key``, downloading at most ``cap + 1`` bytes of it (`read_bounded_future`)."""
    return read_bounded_future(store, key, cap).result()


def stat(store: ts.KvStore, key: str) -> Any:
    """Whether ``key`` exists, and its generation, without downloading it."""
    return store.read(key, byte_range=slice(0, 0)).result()


def exists(store: ts.KvStore, key: str) -> bool:
    return stat(store, key).state == "value"


def committed_arrays(store: ts.KvStore) -> str | None:
    """The arrays prefix the manifest at the root names ("" if none, or no manifest);
    None if a manifest is there that eqxckpt cannot read (then nothing is garbage)."""
    top = read_bounded(store, MANIFEST_NAME, MAX_MANIFEST_BYTES)
    if top.state != "value":
        return ""
    try:
        raw = bytes(top.value)
        doc = parse_json_object(raw, MANIFEST_NAME)  # size and density checked before parsing
        check_checksum(raw, doc, MANIFEST_NAME)  # a flipped bit must not name another prefix
    except ManifestError:
        return None
    arrays = doc.get("arrays", "")
    return arrays if arrays == "" or is_arrays_name(arrays) else None


def collect_garbage(store: ts.KvStore) -> list[str]:
    """Delete the retired prefixes of the checkpoint at ``store`` (`delete_unheld` marked
    them: their checkpoint was replaced or deleted) that no live save or checkpoint refers
    to. Returns the prefixes that nothing explains, left alone.

    A prefix that neither the manifest nor the lease names, and that is not marked
    retired, is not provably eqxckpt's garbage: a copy of a checkpoint in progress (its
    prefix is copied before its manifest) or a user's files look just like it. What
    eqxckpt's own saves leave is finished by their leases (`reclaim`): a save that
    never commits is named by its lease until its prefix is deleted, a commit names
    the prefix it replaces until that is retired. The order matters: list first, then
    read the lease, then the manifest, so that a save whose prefix is listed is seen
    holding its lease or, after, committed.
    """
    listed = {key.decode("utf-8", "replace").split("/")[0] for key in store.list().result()}
    listed = {name for name in listed if is_arrays_name(name)}
    if not listed:
        return []
    current, doc = read_lease(store)
    if current.state == "value" and doc is None:
        return []  # an object eqxckpt did not write holds the lease's name: touch nothing
    keep = set(doc["arrays"]) if doc is not None else set()
    committed = committed_arrays(store)
    if committed is None:
        return []
    unnamed = sorted(listed - keep - {committed})
    marks = [(name, store.read(f"{name}/{RETIRED_NAME}", byte_range=slice(0, 0))) for name in unnamed]
    retired = [name for name, mark in marks if mark.result().state == "value"]
    delete_unheld(store, retired)
    being_retired = set(doc["retire"]) if doc is not None else set()  # by the commit holding the lease
    return [name for name in unnamed if name not in retired and name not in being_retired]


# --- readers: one checkpoint, never a mix -------------------------------------------------


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
