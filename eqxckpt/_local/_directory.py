"""`LocalTier`: one process's directory of a run's local tier, and the parts in it.

```
<local_path>/eqxckpt-local/<run>/process-<k>/own/<step>/     process k's part of <step>
<local_path>/eqxckpt-local/<run>/process-<k>/peer-<j>/<step>/  process j's part, kept by k
```

Each part is an ordinary eqxckpt checkpoint of one process's part of the state (`Part`:
the tree's own leaves, a global array as the blocks this process holds), committed
atomically and checksummed; its metadata's `PartInfo` says whose part of which save, of
which persistent run, it is. ``<run>`` names the persistent place the tier belongs to
(its address and endpoint), so jobs saving to different places never share parts;
``process-<k>`` lets several processes share one local directory, and is held (a lock)
by one manager at a time. Nothing outside ``eqxckpt-local/<run>/process-<k>`` is ever
touched; inside it, only committed parts and what interrupted saves left, in real
directories (a symlink among them is never followed).
"""

import dataclasses
import errno
import functools
import hashlib
import json
import os
import pathlib
import re
import stat
import uuid
import weakref
from typing import Any

import numpy as np

from .._check._verify import verify_location
from .._errors import ArgumentError, CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, warn_at_caller
from .._manifest import parse_manifest
from .._paths import LOCAL_TIER_NAME, MANIFEST_NAME
from .._read._checkpoint import Checkpoint, open_checkpoint
from .._run._steps import clean_leftovers, is_step_name
from .._storage import BufferStorage, Storage, resolve
from .._storage._locks import DirLock
from .._stored import unwritten_at
from .._window import read_window, run_windowed
from .._write._save import Part

# The key of a part's own record in its checkpoint's metadata.
PART_KEY = "eqxckpt.local"
# The fields of that record, and their types.
_FIELDS = {"owner": int, "step": int, "token": str, "processes": int, "run": str, "follows": (int, type(None))}


@dataclasses.dataclass(frozen=True)
class PartInfo:
    """A part as its metadata describes it: whose part (``owner``) of which save (``step``,
    ``token``: the one save of that step it belongs to) of a job of ``processes``
    processes, of which persistent run (``run``, its identity; ``follows``, the newest
    persistent step when it was saved), and who keeps it (``holder``)."""

    owner: int
    step: int
    token: str
    processes: int
    run: str
    follows: int | None
    holder: int

    def record(self) -> dict[str, Any]:
        """What its checkpoint's metadata holds (`PART_KEY`)."""
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def of(cls, record: Any, holder: int, where: str) -> "PartInfo":
        """The part a checkpoint's `PART_KEY` record describes, checked field by field."""
        if not isinstance(record, dict) or record.keys() != _FIELDS.keys():
            raise CheckpointError(f"{where} is not a local-tier part: its {PART_KEY!r} record is {str(record)[:200]}.")
        for name, kind in _FIELDS.items():
            value = record[name]
            if not isinstance(value, kind) or isinstance(value, bool) or (isinstance(value, int) and value < 0):
                raise CheckpointError(f"{where}: its {PART_KEY!r} record's {name} is {value!r}.")
        if not re.fullmatch(r"[0-9a-f]{32}:(0|[1-9][0-9]*)", record["token"]) or not record["token"].endswith(
            f":{record['step']}"
        ):
            raise CheckpointError(
                f"{where}: its {PART_KEY!r} record's token {record['token'][:80]!r} is not its save's."
            )
        return cls(**record, holder=holder)

    def to_json(self) -> list:
        return [*self.record().values(), self.holder]

    @classmethod
    def from_json(cls, data: list) -> "PartInfo":
        return cls.of(dict(zip(_FIELDS, data[:-1])), int(data[-1]), "a part listed by another process")


# Errors reading a part that say nothing about the part (the process ran out of something).
_PASSING = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR}


def run_key(persistent: Storage) -> str:
    """The name of a run's local tier: a digest of where its persistent steps are (the
    address, and the endpoint of an object store; on a local disk, the real path, however
    it is spelled: through symlinks, ``..``)."""
    if persistent.local is not None:
        where, spec = os.path.realpath(persistent.local), {}
    else:
        where = str(persistent)
        spec = {k: v for k, v in persistent.kvstore.items() if k in ("driver", "bucket", "path", "endpoint")}
    return hashlib.sha256(json.dumps([where, spec], sort_keys=True).encode()).hexdigest()[:16]


def _directory_error(local_path: Any, why: str) -> ArgumentError:
    return ArgumentError(f"local_path {str(local_path)!r} {why}: give a directory of this host it may write in.")


class LocalTier:
    """Process ``process``'s directory of the local tier under ``local_path`` of the run
    saved persistently at ``persistent``, held by this object until `close`.

    **Arguments:**

    - `local_path`: a directory on a disk or tmpfs of this host.
    - `persistent`: the run's persistent place.
    - `process`: this process's index.

    Raises `ArgumentError` for a ``local_path`` that is no directory it can write in, and
    while another live manager holds the same directory and process index.

    ```python
    tier = LocalTier("/dev/shm/run", resolve("gs://bucket/run"), jax.process_index())
    tier.parts()  # what this process keeps
    ```
    """

    def __init__(self, local_path: str | os.PathLike, persistent: Storage, process: int):
        if not isinstance(local_path, (str, os.PathLike)) or "://" in str(local_path):
            raise ArgumentError(f"local_path must be a directory of this host (a path), got {local_path!r}.")
        if "\0" in str(local_path):
            raise _directory_error(local_path, "holds a NUL byte")
        if not str(local_path):
            raise _directory_error(local_path, "is empty")
        self.process = process
        self.root = pathlib.Path(local_path) / LOCAL_TIER_NAME / run_key(persistent) / f"process-{process}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _directory_error(local_path, f"cannot hold the local tier ({e.strerror or e})") from None
        for directory in [self.root.parent.parent, self.root.parent, self.root]:
            if directory.is_symlink() or not directory.is_dir():
                raise _directory_error(local_path, f"has {directory}, which is a symlink or not a directory")
        lock = DirLock.take(self.root, exclusive=True)
        if lock is None:
            raise ArgumentError(
                f"Another live CheckpointManager holds the local tier {self.root} (the same local_path, run and "
                "process index): two would delete each other's parts. Give each job its own local_path."
            )
        # Let go when closed, or when dropped unclosed (garbage-collected).
        self._release = weakref.finalize(self, lock.release)
        own = self.root / "own"
        if own.is_symlink() or (own.exists() and not own.is_dir()):
            self.close()
            raise ArgumentError(
                f"The local tier's directory {own} is a symlink or not a directory: eqxckpt keeps this process's "
                "parts only in a directory of its own, never through a link. Remove it (what it points to is left "
                "alone)."
            )
        if not os.access(self.root, os.W_OK):
            self.close()
            raise _directory_error(local_path, "is not writable")
        for _, directory in self._directories():
            if left_alone := clean_leftovers(directory):
                warn_at_caller(left_alone)

    def close(self) -> None:
        """Let another manager hold this directory."""
        self._release()

    def _directory(self, owner: int) -> Storage:
        """Where ``owner``'s parts are kept here: a real directory (made if missing), never
        through a symlink (eqxckpt writes and deletes only inside its own directories)."""
        path = self.root / ("own" if owner == self.process else f"peer-{owner}")
        if not path.exists() and not path.is_symlink():
            path.mkdir()
        if path.is_symlink() or not path.is_dir():
            raise CheckpointError(
                f"Local tier: {path} is a symlink or not a directory; eqxckpt keeps its parts only in directories "
                "of its own. Remove it (what it points to is left alone)."
            )
        return resolve(path)

    def _directories(self) -> list[tuple[int, Storage]]:
        """(whose parts, the directory) for each real directory of parts here; a symlink
        among them is skipped with a warning, never followed."""
        found = []
        for entry in sorted(self.root.iterdir()):
            if entry.name == "own":
                owner = self.process
            elif (
                entry.name.startswith("peer-")
                and entry.name[5:].isdigit()
                and entry.name[5:] == str(int(entry.name[5:]))
            ):
                owner = int(entry.name[5:])
            else:
                continue
            if not stat.S_ISDIR(os.lstat(entry).st_mode):
                warn_at_caller(f"Local tier: skipped {entry}, which is not a directory of its own (a symlink?).")
                continue
            found.append((owner, resolve(entry)))
        return found

    def parts(self) -> list[PartInfo]:
        """Every committed part this process keeps (its own and its peers'), as stored now.
        A part that cannot be read is left out with a warning.

        **Returns:** a list of `PartInfo`.
        """
        found = []
        for owner, directory in self._directories():
            for name, state in directory.entries():
                if state != "committed" or not is_step_name(name):
                    continue
                where = directory.sub(name)
                try:
                    info = PartInfo.of(open_checkpoint(where).metadata.get(PART_KEY), self.process, str(where))
                except CheckpointError as e:
                    warn_at_caller(f"Local tier: skipped {where}: {e}")
                    continue
                if info.step == int(name) and info.owner == owner:
                    found.append(info)
        return found

    def write(self, info: PartInfo, part: Part) -> None:
        """Keep ``part`` as the part ``info`` describes, replacing a part of another save of
        that step (one that never completed)."""
        self._make_way(info.owner, info.step)
        path = self._directory(info.owner).sub(str(info.step)).user_path()
        # Not synced: a host that fails loses its tier anyway, and a part a power cut damaged
        # fails its checks when a restore reads it, and is set aside.
        part.write(path, metadata={PART_KEY: info.record()}, overwrite=True, durable=False)

    def files(self, info: PartInfo) -> list[tuple[str, np.ndarray]]:
        """The files of the committed part ``info`` (its manifest last), as bytes: what a
        peer is sent to keep a copy. Only plain files of real directories."""
        root = self._directory(info.owner).sub(str(info.step)).local
        assert root is not None
        found: list[tuple[str, np.ndarray]] = []
        pending = [""]
        try:
            while pending:
                relative = pending.pop()
                with os.scandir(root / relative) as entries:
                    for entry in entries:
                        key = f"{relative}{entry.name}"
                        if entry.is_dir(follow_symlinks=False):
                            pending.append(f"{key}/")
                        elif entry.is_file(follow_symlinks=False):
                            found.append((key, np.fromfile(entry.path, np.uint8)))
                        else:
                            raise CorruptCheckpointError(
                                f"Local tier: {entry.path} is not a plain file; the part is damaged."
                            )
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"Local tier: the part at {root} was deleted meanwhile.") from None
        except OSError as e:
            if e.errno in _PASSING:
                raise CheckpointError(f"Local tier: cannot read the part at {root} now: {e}.") from None
            # Its keeper cannot read it (EIO, EACCES...): as damaged as a failed checksum.
            raise CorruptCheckpointError(f"Local tier: cannot read the part at {root}: {e}.") from None
        return sorted(found, key=lambda item: (item[0] == MANIFEST_NAME, item[0]))

    def receive(self, owner: int, step: int, files: list[tuple[str, np.ndarray]]) -> None:
        """Keep process ``owner``'s part of ``step`` from its files (`files` there), committed
        atomically as its own save would be; checked when a restore chooses it."""
        *arrays, (name, raw) = files
        where = self._directory(owner).sub(str(step))
        if name != MANIFEST_NAME:
            raise CheckpointError(f"Local tier: the copy of {where} sent by its owner has no manifest.")
        manifest = parse_manifest(raw.tobytes(), str(where))
        self._make_way(owner, step)
        staging = where.begin_save([], overwrite=True)
        try:
            writer = staging.storage.chunk_files()
            # Through the I/O threads' window, as a save writes its chunks.
            tasks = [(data.nbytes, functools.partial(writer.writing, key, [data]), None) for key, data in arrays]
            run_windowed(tasks, read_window(sum(data.nbytes for _, data in arrays)))
            staging.commit(manifest, {key: data.nbytes for key, data in arrays})
        except BaseException as e:
            staging.abort(e)
            raise
        finally:
            staging.release()

    def _make_way(self, owner: int, step: int) -> None:
        """Before process ``owner``'s part of ``step`` is written here: what is at its place
        is replaced only if it is such a part eqxckpt wrote (its manifest reads, it records
        that owner and step, and it holds nothing its manifest does not name); anything else
        (a part whose manifest was lost or damaged, another checkpoint, a user's files) is
        moved aside (`_move_aside`), never deleted."""
        where = self._directory(owner).sub(str(step))
        path = where.local
        assert path is not None
        if not os.path.lexists(path):
            return
        if path.is_symlink() or not path.is_dir():
            self._move_aside(path, "is not a directory (a link, a file)", "the new part put in its place")
            return
        try:
            opened = open_checkpoint(where)
            info = PartInfo.of(opened.metadata.get(PART_KEY), self.process, str(where))
            unwritten = opened.stored.unwritten()
        except CheckpointError as e:
            self._move_aside(path, f"held no part this tier can read ({e})", "the new part put in its place")
            return
        if (info.owner, info.step) != (owner, step):
            self._move_aside(
                path, f"held process {info.owner}'s part of step {info.step}", "the new part put in its place"
            )
        elif unwritten:
            self._move_aside(
                path, f"held files eqxckpt did not write ({unwritten[0]})", "the new part put in its place"
            )

    def set_aside(self, info: PartInfo, why: str) -> None:
        """Move the part ``info``, found damaged (``why``), aside (`_move_aside`): it is never
        chosen again, and a sound copy may take its place. Nothing if it is no longer there."""
        try:
            self.open(info)
        except CheckpointError:
            return
        path = self._directory(info.owner).sub(str(info.step)).local
        assert path is not None
        self._move_aside(path, f"is damaged ({why})", "it is never restored")

    def _move_aside(self, path: pathlib.Path, what: str, then: str) -> None:
        """Rename ``path`` to a hidden name, with a warning: eqxckpt cannot prove it wrote
        what is in it (or it is damaged), so it deletes none of it."""
        aside = path.with_name(f".{path.name}.set-aside-{uuid.uuid4().hex[:8]}")
        os.rename(path, aside)
        warn_at_caller(f"Local tier: {path} {what}; it was moved to {aside} and {then}.")

    def open(self, info: PartInfo) -> Checkpoint:
        """The part ``info`` names, opened for a restore of this process (`Source.per_process`).
        Raises `CheckpointError` if it was replaced meanwhile."""
        return _opened(self._directory(info.owner).sub(str(info.step)), info, "it was replaced meanwhile. Load again")

    def unsound(self, info: PartInfo, files: list[tuple[str, np.ndarray]]) -> str | None:
        """What `verify` finds wrong with the copy of part ``info`` a peer sent (`files`),
        held in memory, or None: every chunk and digest checked, whatever a restore read."""
        report = verify_location(BufferStorage.of(dict(files), f"process {info.owner}'s part of step {info.step}"))
        return None if report.ok else str(report)

    def received(self, info: PartInfo, files: list[tuple[str, np.ndarray]]) -> Checkpoint:
        """The copy of part ``info`` a peer sent (its `files`), opened for a restore of this
        process as it is held in memory: read once, checked as it is read, and kept here
        afterwards (`receive`) if it is sound. Raises `CorruptCheckpointError` if it is
        not the part ``info`` names."""
        where = BufferStorage.of(dict(files), f"process {info.owner}'s part of step {info.step} as sent to it")
        try:
            return _opened(where, info, "the copy is damaged")
        except CheckpointError as e:
            if isinstance(e, CorruptCheckpointError):
                raise
            raise CorruptCheckpointError(str(e)) from None

    def delete(self, parts: list[PartInfo]) -> None:
        """Delete these parts (this process's own, listed by `parts`)."""
        for info in parts:
            assert info.holder == self.process
            where = self._directory(info.owner).sub(str(info.step))
            if (keep := unwritten_at(where)) and where.delete(keep):
                warn_at_caller(
                    f"Local tier: deleted the part at {where} but kept {len(keep)} files eqxckpt did not write in it, "
                    f"in {where}.kept-<hex> beside it: {', '.join(keep[:10])}.",
                )
            elif not keep:
                where.delete()


def _opened(where: Storage, info: PartInfo, otherwise: str) -> Checkpoint:
    """The part ``info`` at ``where``, opened for a restore of this process; a
    `CheckpointError` saying ``otherwise`` if it holds another."""
    opened = open_checkpoint(where, per_process=True)
    found = PartInfo.of(opened.metadata.get(PART_KEY), info.holder, str(where))
    if found != info:
        raise CheckpointError(
            f"Local tier: {where} is not process {info.owner}'s part of step {info.step}'s save {info.token} "
            f"(it holds {found.token!r}): {otherwise}."
        )
    return opened
