"""The storage interface: `Storage` (where a checkpoint lives, and its backend's
side of the concurrency protocol) and `Staging` (a save in progress).

The implementations: `LocalStorage` (`_local.py`) and `ObjectStorage`
(`_objects.py`); `resolve` (`_resolve.py`) picks one for a user's path.
"""

import abc
import contextlib
import dataclasses
import functools
import os
import pathlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np
import tensorstore as ts

from .._chunks import ChunkFileError, ChunkFiles, ChunkLayout
from .._errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
)
from .._leaf import StoredLeaf
from .._manifest import Manifest
from .._paths import GROUP_METADATA, LOCAL_TIER_NAME, RUN_NAME, group_file, group_locations, validate_path
from .._tensorstore import reason, shared_context
from .._window import blocking, done, host_memory_budget
from ._kvstore import MIN_PART_BYTES, PART_BYTES, PartError, SizeError, read_parts, stat_future
from ._pins import Pin

# Where a checkpoint is: a local path, a URL (file://, memory://, s3://, gs://), or a TensorStore kvstore spec.
CheckpointPath = str | os.PathLike[str] | dict[str, Any]
MAX_ZARR_JSON_BYTES = 64 * 1024
NOTHING_COMMITTED = (
    "Nothing was committed and any previous checkpoint at this place is intact; free space or fix "
    "permissions, then save again."
)


# Where eqxckpt takes object stores' endpoints from (besides a kvstore spec's own "endpoint").
ENDPOINT_SETTINGS = "AWS_ENDPOINT_URL for S3, TENSORSTORE_GCS_HTTP_URL for a Cloud Storage emulator"


def environment_endpoint() -> str | None:
    """The S3-compatible endpoint AWS tools take from the environment, if any."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")


# How object stores say no. A refused HEAD (S3's first request) has no body: only its status
# says why. (A local file's PERMISSION_DENIED carries no HTTP status: its fix is the default's.)
DENIED = (
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "http_response_code='401'",
    "http_response_code='403'",
    "UNAUTHENTICATED",
)
CREDENTIAL_SETTINGS = (
    "for S3, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or ~/.aws/credentials; for Cloud Storage, "
    "gcloud auth application-default login or GOOGLE_APPLICATION_CREDENTIALS"
)


def nothing_committed(failure: str) -> str:
    """What to tell after a failed save, given why it failed: the usual fix for the cause."""
    if "NoSuchBucket" in failure or "NOT_FOUND" in failure:  # S3 names it; Cloud Storage answers 404
        fix = "create the bucket or fix its name"
    elif "CURL error" in failure or "Could not connect" in failure or "Could not resolve" in failure:
        fix = f"check the endpoint ({ENDPOINT_SETTINGS}), the network and the credentials"
    elif any(word in failure for word in DENIED):
        fix = f"check the credentials ({CREDENTIAL_SETTINGS}) and the bucket's permissions"
    else:
        return NOTHING_COMMITTED
    return f"Nothing was committed and any previous checkpoint at this place is intact; {fix}, then save again."


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
        """The checkpoint's root as an open TensorStore key-value store, opened once per
        `Storage` (a load reads every leaf's ``zarr.json`` through it)."""
        return self._kvstore

    @functools.cached_property
    def _kvstore(self) -> ts.KvStore:
        return ts.KvStore.open(self.kvstore, context=shared_context()).result()

    @property
    def local(self) -> pathlib.Path | None:
        """The directory, for local storage; None for object stores."""
        return None

    def generations(self, keys: Sequence[str]) -> list[str | None]:
        """The generation the store reports for each of ``keys`` now (hex), without
        downloading any: one metadata request each (a HEAD on S3), all in flight at once.
        None for a key that is missing or could not be asked about: a caller then trusts
        nothing it recorded of that object.

        ```python
        storage.generations(["w/zarr.json", "w/c/0"])  # ['0022...', '0022...']
        ```
        """
        store = self.open_kvstore()
        asked = [stat_future(store, key) for key in keys]
        found: list[str | None] = []
        for read in asked:
            try:
                result = read.result()
            except Exception:  # noqa: BLE001 - unknown: checked whole instead
                found.append(None)
                continue
            generation = result.stamp.generation
            found.append(generation.hex() if result.state == "value" and generation else None)
        return found

    def chunk_files(self) -> ChunkFiles:
        """The chunk files of the arrays here, read and written as bytes (see `_chunks`)."""
        return KvChunkFiles(self.open_kvstore(), self._generations_read)

    # While `recording_generations` is active: {key: the generations its reads returned}
    # (set on the instance, whose fields are frozen: it is no part of what the storage is).
    _generations_read: ClassVar["dict[str, set[str]] | None"] = None

    @contextlib.contextmanager
    def recording_generations(self) -> Iterator[dict[str, set[str]]]:
        """Record, while active, the generation of each chunk file every read through
        `chunk_files` returned (hex; on object stores): what a check read is what it can
        vouch for (a HEAD before and after could see the same ETag around other bytes).

        ```python
        with storage.recording_generations() as read:
            check(storage)
        read["w/c/0"]  # {'0022...'}: one generation, the bytes checked
        ```
        """
        previous, recorded = self._generations_read, {}
        object.__setattr__(self, "_generations_read", recorded)
        try:
            yield recorded
        finally:
            object.__setattr__(self, "_generations_read", previous)

    @abc.abstractmethod
    def sub(self, name: str) -> "Storage":
        """The storage of an entry of this directory (a manager's step)."""

    @abc.abstractmethod
    def user_path(self) -> CheckpointPath:
        """What `save`, `load` and `open` accept to name this place (a path, or a kvstore spec)."""

    # -- reading ------------------------------------------------------------------------

    @abc.abstractmethod
    def read_manifest(self) -> tuple[Manifest, Pin]:
        """A committed checkpoint's manifest, or an error saying exactly why there is none,
        with what pins that checkpoint (so a reader can tell if it was replaced meanwhile)."""

    def arrays(self, manifest: Manifest) -> "Storage":
        """Where the arrays of the checkpoint that ``manifest`` describes are: beside it,
        except on object stores, where each save has a prefix of its own (a copy of such a
        checkpoint on a local disk keeps that layout, and reads the same)."""
        return self.sub(manifest.arrays) if manifest.arrays else self

    def referenced(self, ref: str) -> "Storage":
        """Where a leaf whose ``arrays`` is ``ref`` (a sibling checkpoint's prefix) is.
        Only object stores have such leaves: their protocol keeps what a live checkpoint
        refers to, which a local disk's retention would not."""
        raise CheckpointError(
            f"{self} refers to leaves in another checkpoint ({ref}): an incremental save on an object store "
            "wrote it, and it can only be read and managed there. Load it from the object store, or make a "
            "checkpoint of its own from there with eqxckpt.save(new_path, eqxckpt.open(step_path).tree())."
        )

    def sibling_name(self, other: "Storage") -> str | None:
        """``other``'s name if it is a checkpoint beside this one (an entry of the same
        directory, on the same store) to which this one's leaves may refer; else None."""
        return None

    @abc.abstractmethod
    def read_leaf_metadata(self, leaf: StoredLeaf) -> ts.Future:
        """Start reading a leaf's ``zarr.json``, after checking its files may be read: its
        bytes, or None if there is none."""

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

    def entries(self) -> list[tuple[str, str]]:
        """(name, state) for each visible entry, sorted: ``committed`` (holds a committed
        checkpoint), ``busy`` (a save or deletion holds it), ``retired`` (only the arrays
        of a deleted checkpoint, which newer ones still refer to) or ``other``. A run's
        identity (`RUN_NAME`) and a local tier kept in the run's own directory
        (`LOCAL_TIER_NAME`) are no entries: every reader of a run's entries (its steps,
        cleanup, ``eqxckpt verify RUN/``) leaves them alone, without a word."""
        return [(name, state) for name, state in self.list_entries() if name not in (RUN_NAME, LOCAL_TIER_NAME)]

    @abc.abstractmethod
    def list_entries(self) -> list[tuple[str, str]]:
        """Everything `entries` lists, the run's identity included (the backend's listing)."""

    def committed_entries(self) -> list[str]:
        """The names of the committed checkpoints in this directory (a manager's steps), steps
        by number first."""
        return sorted((name for name, state in self.entries() if state == "committed"), key=entry_order)

    def run_directory_error(self) -> CheckpointNotFoundError | None:
        """If this place is no checkpoint but holds committed ones (a run directory, passed
        where one of its steps was meant): the error that names them; else None."""
        inside = self.committed_entries()
        if not inside:
            return self._empty_run_error()
        numbered = all(name.isdigit() for name in inside)
        listed = ", ".join(inside[:20]) + (f", ... ({len(inside)} in all)" if len(inside) > 20 else "")
        example = str(self).rstrip("/") + "/" + inside[-1]
        return CheckpointNotFoundError(
            f"{str(self).rstrip('/')} is not a checkpoint but a directory of {len(inside)} checkpoint"
            + ("s" if len(inside) > 1 else "")
            + (" (a CheckpointManager run)" if numbered else "")
            + f": {listed}. Load one of them, e.g. eqxckpt.load({example!r}, ...)"
            + (", or CheckpointManager(...).load(like) for the latest step." if numbered else ".")
        )

    def _empty_run_error(self) -> CheckpointNotFoundError | None:
        """If this place holds a run's identity and no committed checkpoint (a manager's run
        before its first step committed): the error that says so; else None."""
        try:
            if self.read_small(RUN_NAME, 0) is None:
                return None
        except OSError:
            pass  # something is there under that name: a run's, damaged
        return CheckpointNotFoundError(
            f"{str(self).rstrip('/')} is not a checkpoint but a CheckpointManager run with no committed step yet "
            f"(it holds the run's identity, {RUN_NAME}). Load one of its steps once one is saved, e.g. "
            "CheckpointManager(...).load(like) for the latest."
        )

    @abc.abstractmethod
    def clean_leftovers(self, entries: Callable[[str], bool]) -> list[str]:
        """Remove what interrupted saves and deletions left for the entries of this directory
        that ``entries`` accepts (a manager's steps), where provably abandoned and eqxckpt's;
        nothing of any other entry is touched. Returns what looks like eqxckpt's but was left
        alone, not provably so (object stores: a prefix no lease or manifest explains)."""

    def leaf_files(self, path: str) -> dict[str, int] | None:
        """``{key: size}`` of the files of the leaf at ``path``, keys as `expected_files`
        names them, where a save may take them as they are (`Staging.link_files`); None
        where it may not: not on a local disk, missing, or anything but plain files."""
        return None

    def sharers(self, manifest: Manifest, leaf: StoredLeaf) -> list[str]:
        """The names of the checkpoints beside this one (entries of the same directory,
        numbers in order) that hold the very files ``leaf`` of this one (``manifest``) is
        stored in: hard links to them on a local disk, references to the same prefix on
        an object store (incremental saves). Damage to those files is damage to each of
        them. Empty where none does."""
        return []

    def beside(self) -> list["Storage"]:
        """The committed checkpoints beside this one (entries of the same directory, numbers
        in order): where `verify` with ``repair=True`` looks for a twin of a damaged leaf.
        Empty where there is no such directory (a copy held in memory)."""
        return []

    def mend(self, key: str, raw: bytes, pin: Pin) -> None:
        """Make the file ``key`` of these arrays hold ``raw`` (bytes of a verified twin), in
        place, in the checkpoint ``pin`` ties them to (`StoredArrays.mend`): on a local disk
        the file itself is rewritten in the directory held open since its manifest was read
        (never in one that replaced it), so every checkpoint sharing it (hard links) is
        mended; on an object store the object is written again on condition that it is
        the one there now (never created: a prefix deleted meanwhile stays deleted), so
        every checkpoint referring to its prefix is. Raises `CheckpointWriteError` where
        it cannot.

        ```python
        stored.files_of(leaf).mend("w/c/0/0", good_bytes, pin)
        ```
        """
        raise CheckpointWriteError(f"{self} cannot be mended: it is read-only here.")

    @abc.abstractmethod
    def delete(self, keep: Sequence[str] = ()) -> bool:
        """Uncommit, then remove, this checkpoint; False if it is in use (try again later).
        ``keep``: files in it (relative paths, as `StoredArrays.unwritten` names them) that
        eqxckpt did not write: kept as they were, in ``<name>.kept-<hex>`` beside it (a
        local disk; an object store deletes only keys eqxckpt wrote anyway)."""

    # -- small files of a directory of checkpoints (a run's identity) ---------------------

    @abc.abstractmethod
    def read_small(self, name: str, cap: int) -> bytes | None:
        """The bytes of the file ``name`` in this directory, or None if there is none.

        **Arguments:**

        - `name`: the file's name (`RUN_NAME`).
        - `cap`: at most ``cap + 1`` bytes are read: more, and the caller refuses it.

        **Returns:** its bytes, or None. A local file that is a symlink, a directory or
        anything but a regular file raises `OSError` (it is never followed).

        ```python
        resolve("run").read_small(RUN_NAME, 4096)  # b'{"run": "3f2c...", "format": 1}\n'
        ```
        """

    @abc.abstractmethod
    def create_once(self, name: str, raw: bytes) -> bool:
        """Create the file ``name`` in this directory holding ``raw``, only if there is none.

        Atomic: no reader ever sees the file part-written, and of creators racing, one
        creates it and the others find it there (local disks: a hard link of a fully
        written temporary; object stores: a write on condition that the key is absent,
        as a lease is taken). The directory is created if needed. eqxckpt never replaces
        or deletes a file it creates this way.

        **Arguments:**

        - `name`: the file's name (`RUN_NAME`).
        - `raw`: its bytes.

        **Returns:** True if this call created it; False if it was there already.

        ```python
        resolve("run").create_once(RUN_NAME, raw)  # True, then False ever after
        ```
        """

    # -- whole files of a directory another tool reads (a published HuggingFace model) -----

    def put_file(self, name: str, pieces: Iterable[Any], overwrite: bool, seen: str | None = None) -> str:
        """Write the file ``name`` in this directory whole: ``pieces`` (buffers, taken in
        turn) one after another. Atomic: a reader finds the old file, or none, until the
        new one is complete (local disks: a durable temporary renamed into place; object
        stores: one write of the object). Without ``overwrite``, a file there already is
        never replaced: `CheckpointExistsError`.

        **Arguments:**

        - `name`: the file's name (``model-00001-of-00002.safetensors``).
        - `pieces`: its bytes, as buffers, taken in turn: a generator may make each as
          it is asked for, and reuse its memory for the next (a writer that keeps a
          piece copies it).
        - `overwrite`: whether a file there may be replaced.
        - `seen`: the stamp the file had when this writer took the directory
          (`publishing`; ``""``: none there). On an object store the write is made on
          condition that it is still that (`CheckpointBusyError` if not: another writer
          took the directory over meanwhile); a local directory is held by its lock.

        **Returns:** the stamp of the file written (`file_stamp`'s): while the file is
        the one written, `file_stamp` gives it back.

        ```python
        stamp = resolve("published").put_file("model.safetensors", [head, data], overwrite=False)
        ```
        """
        raise CheckpointWriteError(f"{self} is read-only here: {name} cannot be written.")

    def file_stamp(self, name: str) -> str | None:
        """What tells the file ``name`` from any other written in its place (local disks:
        its device, inode, size and modification time; object stores: its generation),
        or None if there is none.

        ```python
        assert resolve("published").file_stamp("model.safetensors") == stamp
        ```
        """
        return None

    def remove_file(self, name: str) -> bool:
        """Remove the file ``name`` of this directory, durably; False if there was none.
        A directory in its place is a `CheckpointWriteError` (never removed).

        ```python
        resolve("published").remove_file("model.safetensors.index.json")
        ```
        """
        raise CheckpointWriteError(f"{self} is read-only here: {name} cannot be removed.")

    def file_exists(self, name: str) -> bool:
        """Whether this directory holds a file (or anything) named ``name``.

        ```python
        resolve("published").file_exists("model.safetensors.index.json")
        ```
        """
        return False

    @contextlib.contextmanager
    def publishing(self) -> Iterator[None]:
        """Hold this directory against other writers of whole files while the block runs
        (local disks: an exclusive ``flock`` of the directory itself, so no file is
        added; another writer holding it is a `CheckpointBusyError` at once). Object
        stores hold nothing: their writers' files are told apart by `file_stamp`.

        ```python
        with resolve("published").publishing():
            ...  # write the files, then the index
        ```
        """
        yield


class Staging(abc.ABC):
    """A save in progress: where its arrays go, and how it commits or is abandoned."""

    storage: Storage
    where: str = ""  # told to the other processes of a multi-process save

    def sync(self) -> None:
        """Make what this process wrote durable."""
        return None

    def link_files(self, base: "Storage", keys: list[str]) -> None:
        """Take the files ``keys`` of ``base`` (a committed checkpoint's arrays, as
        `Storage.leaf_files` listed and checked them) into this save as they are."""
        raise NotImplementedError(f"{type(self).__name__} cannot take files from another checkpoint.")

    def refer(self, refs: list[str]) -> set[str]:
        """Of ``refs`` (sibling checkpoints' prefixes, see `Storage.referenced`), those this
        save's leaves may refer to instead of being written: held for it until it ends
        or its checkpoint is deleted. None on local disks, which link files instead."""
        return set()

    @abc.abstractmethod
    def commit(self, manifest: Manifest, expected: dict[str, int]) -> None:
        """Check every expected file is there, write the manifest, make it visible."""

    def abort(self, error: BaseException) -> None:
        """Remove what this save wrote (if this process owns it); may add a note to ``error``."""
        return None

    def release(self) -> None:
        """Give up what this process holds (locks)."""
        return None

    # How to find the files of the checkpoint this save replaces that eqxckpt did not write
    # (`Storage.delete`'s ``keep``), asked of it once it is replaced (local disks): what it
    # holds then, not at the save's start. What was found, and where it was left.
    unwritten: "Callable[[Storage], list[str]] | None" = None
    keep_replaced: Sequence[str] = ()
    kept_at: "pathlib.Path | None" = None


class KvChunkFiles(ChunkFiles):
    """Chunk files in a TensorStore kvstore (object stores, memory). As coroutines
    (`reading`, `writing`), a request in flight holds no I/O thread: the window of bytes
    bounds how many are in flight. A large chunk is read as ranges of `PART_BYTES`, at most
    the host memory budget of them at once."""

    def __init__(self, store: ts.KvStore, generations_read: "dict[str, set[str]] | None" = None):
        self._store = store
        self._generations_read = generations_read  # see `Storage.recording_generations`

    def write(self, key: str, pieces: Sequence[np.ndarray]) -> None:
        blocking(self.writing(key, pieces))

    def read(self, key: str, into: Sequence[np.ndarray], at: int = 0, size: int | None = None) -> None:
        blocking(self.reading(key, into, at, size))

    async def writing(self, key: str, pieces: Sequence[np.ndarray]) -> None:
        written = self._store.write(key, b"".join(piece.data for piece in pieces))
        await done([written])
        written.result()

    async def reading(self, key: str, into: Sequence[np.ndarray], at: int = 0, size: int | None = None) -> None:
        end = at + sum(buffer.nbytes for buffer in into)
        wanted = end if size is None else size
        # Ranged parts in flight hold their bytes until they are copied into place: at
        # most the host memory budget of them at once (a large chunk, a small budget).
        budget = host_memory_budget()
        part = min(PART_BYTES, max(MIN_PART_BYTES, budget))
        group = max(part, budget // part * part)
        targets = _Targets(into)
        generations = set()
        for start in range(at, end, group) if end > at else range(at, at + 1):
            # Never more than the chunk's size is downloaded: a larger object is refused unread
            # (the byte past its end is asked for too), a smaller one when a range passes its end.
            parts = read_parts(self._store, key, wanted, part, start, min(start + group, end))
            await done([parts])
            try:
                results = parts.result()
            except SizeError as e:
                held = f"more than {wanted}" if e.size is None else str(e.size)
                raise ChunkFileError(f"chunk file {key} holds {held} bytes, not {wanted}") from None
            except PartError as e:
                raise ChunkFileError(
                    f"chunk file {key} holds {wanted} bytes as it should, but {e}: read it again"
                ) from None
            if any(result.state != "value" for result in results):
                raise ChunkFileError(f"chunk file {key} is missing")
            generations.update(result.stamp.generation for result in results)
            if len(generations) > 1:
                raise ChunkFileError(f"chunk file {key} was replaced while it was read")
            values = [result.value for result in results]
            if sum(len(value) for value in values) != min(group, end - start):  # each range was checked whole
                raise ChunkFileError(f"chunk file {key} was cut short while it was read")
            for value in values:
                targets.put(value)
            del values, results
        targets.finish()
        if self._generations_read is not None:
            self._generations_read.setdefault(key, set()).update(g.hex() for g in generations)


class _Targets:
    """Consecutive buffers filled in order with consecutive runs of a file's bytes."""

    def __init__(self, into: Sequence[np.ndarray]):
        self._buffers = iter(buffer.reshape(-1).view(np.uint8) for buffer in into)
        self._target, self._at = next(self._buffers, None), 0

    def put(self, value: bytes) -> None:
        data = np.frombuffer(value, np.uint8)
        while data.size:
            assert self._target is not None  # the values' total is the buffers'
            n = min(data.size, self._target.size - self._at)
            self._target[self._at : self._at + n] = data[:n]
            data, self._at = data[n:], self._at + n
            if self._at == self._target.size:
                self._target, self._at = next(self._buffers, None), 0

    def finish(self) -> None:
        # Buffers of no bytes may be left; none with bytes: the sizes were checked.
        while self._target is not None:
            assert self._target.size == 0
            self._target = next(self._buffers, None)


def expected_files(leaves: list[tuple[StoredLeaf, ChunkLayout]]) -> dict[str, int]:
    """``{key: size}`` of every file the arrays must consist of: each leaf's
    ``zarr.json`` (size -1: any) and every chunk (the chunk's bytes + a crc32c),
    and the groups' ``zarr.json`` above them."""
    expected: dict[str, int] = {
        group_file(group): len(GROUP_METADATA) for group in group_locations(leaf.path for leaf, _ in leaves)
    }
    for leaf, layout in leaves:
        expected[f"{leaf.path}/zarr.json"] = -1
        expected.update(layout.files(leaf.path))
    return expected


def entry_order(name: str) -> tuple[bool, int, str]:
    """Entries of a directory in the order a user reads them: steps by number, then the rest."""
    return (not name.isdigit(), int(name) if name.isdigit() else 0, name)


def check_complete(found: dict[str, int], expected: dict[str, int]) -> None:
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
        leaf_path=leaf.path,
    )


@contextlib.contextmanager
def reading(leaf: StoredLeaf | Any) -> Iterator[None]:
    """Any failure while reading ``leaf`` becomes a `CorruptCheckpointError` naming it (`corrupt`)."""
    try:
        yield
    except CheckpointError:  # already says what is wrong
        raise
    except Exception as e:
        raise corrupt(leaf, e) from None
