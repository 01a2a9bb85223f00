"""`ObjectStorage`: checkpoints under a prefix of an object store (S3, GCS, memory).

Each save writes its arrays under a prefix of its own, ``%arrays.<hex>/``, which
no other save ever writes, and commits by a conditional write of the manifest
(naming that prefix) over the one it replaces. A lease object fences the
commit, so that a writer paused past its lease cannot commit (`_lease`); the
protocol: docs/concurrency.md ("Object stores").
"""

import contextlib
import dataclasses
import os
import socket
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

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
from .._paths import (
    ARRAYS_PREFIX,
    COMMIT_NAME,
    LEASE_NAME,
    MANIFEST_NAME,
    RETIRED_NAME,
    group_file,
    group_locations,
    is_arrays_name,
    is_entry_name,
    parse_reference,
)
from .._tensorstore import is_storage_error, reason
from ._backend import (
    ENDPOINT_SETTINGS,
    MAX_ZARR_JSON_BYTES,
    NOTHING_COMMITTED,
    Pin,
    Staging,
    Storage,
    check_complete,
    entry_order,
    environment_endpoint,
)
from ._holds import collect_prefix, delete_unheld, run_store, take_hold
from ._kvstore import (
    create_if_absent,
    delete_arrays,
    delete_leaf_keys,
    exists,
    list_keys,
    read_bounded,
    read_bounded_future,
    stat,
    write_manifest,
)
from ._lease import Lease, describe_lease, is_abandoned, read_lease, warn_if_not_atomic
from ._pins import StorePin
from ._reclaim import collect_garbage, finish, reclaim


@dataclasses.dataclass(frozen=True)
class Base:
    """What a save commits over: the manifest's generation when the save took the
    lease (absent, or a checkpoint), whether that is a committed checkpoint, and
    the leaf paths of one written before saves had prefixes of their own."""

    generation: bytes
    committed: bool
    legacy_paths: list[str]
    references: list[str] = dataclasses.field(default_factory=list)  # what its leaves refer to
    arrays: str = ""  # its prefix: retired once the save commits


@dataclasses.dataclass(frozen=True)
class ObjectStorage(Storage):
    """A checkpoint under a prefix of an object store (or TensorStore's memory store)."""

    def open_kvstore(self) -> ts.KvStore:
        check_reachable(self.kvstore, str(self))
        return super().open_kvstore()

    def sub(self, name: str) -> "ObjectStorage":
        return ObjectStorage(self.child(name))

    def user_path(self) -> dict[str, Any]:
        return dict(self.kvstore)

    def __str__(self) -> str:
        spec = self.kvstore
        scheme = {"gcs": "gs"}.get(spec["driver"], spec["driver"])  # as users write it: gs://bucket/path
        return f"{scheme}://{spec.get('bucket', '')}/{spec.get('path', '')}".replace(":///", "://")

    def read_manifest(self) -> tuple[Manifest, Pin]:
        try:
            store = self.open_kvstore()
            result = read_bounded(store, MANIFEST_NAME, MAX_MANIFEST_BYTES)
            if result.state == "value":
                manifest = parse_manifest(bytes(result.value), str(self))
                if manifest.arrays and not exists(store, f"{manifest.arrays}/{COMMIT_NAME}"):
                    if StorePin(self, result.stamp.generation).changed():
                        # Replaced while it was read (an overwrite retired its arrays): read it again.
                        raise CheckpointChangedError(f"The checkpoint at {self} was replaced while it was opened.")
                    if others := _unexplained_commits(store):
                        raise ManifestError(
                            f"{_damaged(self, manifest.arrays, others)} Restore the manifest from a copy, or delete "
                            "the checkpoint (its files are yours to remove), or save over it with overwrite=True."
                        )
                    raise IncompleteCheckpointError(
                        f"No committed checkpoint at {self}: its manifest names arrays ({manifest.arrays}) that "
                        "were deleted (a deletion by retention, or a writer that resumed after it). Load another "
                        "checkpoint; saving here again replaces it."
                    )
                for ref in manifest.references():
                    if not exists(self.referenced(ref).open_kvstore(), COMMIT_NAME):
                        if StorePin(self, result.stamp.generation).changed():
                            # Deleted while it was read: its base may go once nothing refers to it.
                            raise CheckpointChangedError(f"The checkpoint at {self} was deleted while it was opened.")
                        # Committed, with data gone: damaged, and listed so (never taken for deleted).
                        raise CorruptCheckpointError(
                            f"{self} refers to unchanged leaves in {ref}, which is gone: something other than "
                            "eqxckpt (or an eqxckpt older than format version 4) deleted it. Restore that prefix "
                            "from a copy, or load another checkpoint."
                        )
                return manifest, StorePin(self, result.stamp.generation)
            _, lease = read_lease(store)
            listed = list_keys(store)
        except ValueError as e:
            if not is_storage_error(e):
                raise
            if str(e).startswith("NOT_FOUND"):
                raise CheckpointNotFoundError(
                    f"No checkpoint at {self}: {reason(e)} (is the bucket's name right?)"
                ) from None
            raise CheckpointError(
                f"Cannot read {self}: {reason(e)}. Check the endpoint ({ENDPOINT_SETTINGS}), the network and the "
                "credentials."
            ) from None
        if lease is not None and not is_abandoned(lease) and lease.get("purpose") != "save":
            raise CheckpointNotFoundError(f"No checkpoint at {self}: it is being deleted ({describe_lease(lease)}).")
        if lease is not None and not is_abandoned(lease):
            raise IncompleteCheckpointError(
                f"No committed checkpoint at {self} right now: a save is writing it, or was killed less than "
                f"its lease's timeout ago ({describe_lease(lease)}). Load it again once that save has finished, or "
                "load an earlier checkpoint."
            )
        if listed and (run_directory := self.run_directory_error()) is not None:
            raise run_directory
        if listed:
            raise IncompleteCheckpointError(
                f"{self} has data but no {MANIFEST_NAME}: no save committed a checkpoint there (one was "
                "interrupted, or this is not an eqxckpt checkpoint). Load an earlier checkpoint, or save elsewhere."
            )
        raise CheckpointNotFoundError(
            f"No checkpoint at {self}: nothing is stored under that prefix (check the bucket's name and the path)."
        )

    def directory(self) -> tuple[dict[str, Any], str]:
        """The directory this checkpoint is in (a kvstore spec), and its name there: "" if
        it is no name a sibling may refer to (as `_holds.run_store` decides for holds)."""
        head, _, name = str(self.kvstore.get("path", "")).rstrip("/").rpartition("/")
        return {**self.kvstore, "path": f"{head}/" if head else ""}, name if is_entry_name(name) else ""

    def _sibling(self, entry: str) -> "ObjectStorage":
        parent, _ = self.directory()
        return ObjectStorage({**parent, "path": f"{parent['path']}{entry}/"})

    def referenced(self, ref: str) -> "ObjectStorage":
        entry, arrays = parse_reference(ref, str(self))
        return self._sibling(entry).sub(arrays)

    def sibling_name(self, other: Storage) -> str | None:
        if not isinstance(other, ObjectStorage):
            return None
        (mine, name), (theirs, entry) = self.directory(), other.directory()
        return entry if name and entry and entry != name and mine == theirs else None

    def prefix_of(self, manifest: Manifest, leaf: StoredLeaf) -> tuple[str, str] | None:
        """(entry, arrays): the sibling's (or this checkpoint's own) prefix ``leaf`` is in;
        None where it cannot be named (not an entry of a directory, or no prefix)."""
        if leaf.arrays:
            return parse_reference(leaf.arrays, str(self))
        _, name = self.directory()
        return (name, manifest.arrays) if name and manifest.arrays else None

    def sharers(self, manifest: Manifest, leaf: StoredLeaf) -> list[str]:
        parent, name = self.directory()
        mine = self.prefix_of(manifest, leaf)
        if mine is None:
            return []
        found = []
        for entry, state in ObjectStorage(parent).entries():
            if state != "committed" or entry == name:
                continue
            sibling = self._sibling(entry)
            try:
                theirs, _ = sibling.read_manifest()
                record = {r.path: r for r in theirs.leaves}.get(leaf.path)
                if isinstance(record, StoredLeaf) and sibling.prefix_of(theirs, record) == mine:
                    found.append(entry)
            except CheckpointError:
                continue  # deleted or replaced meanwhile, or damaged: it shares nothing that can be told
        return sorted(found, key=entry_order)

    def beside(self) -> list[Storage]:
        parent, name = self.directory()
        if not name:
            return []
        return [
            self._sibling(entry)
            for entry, state in ObjectStorage(parent).entries()
            if state == "committed" and entry != name
        ]

    def mend(self, key: str, raw: bytes, pin: Pin) -> None:
        store = self.open_kvstore()
        try:
            found = stat(store, key)
            if found.state != "value":
                raise CheckpointWriteError(
                    f"{self}{key} is missing: only objects that are there are written again (its prefix may be "
                    "deleted). Save the step again to replace it."
                )
            store.write(key, raw, if_equal=found.stamp.generation).result()
        except Exception as e:
            if isinstance(e, CheckpointError) or not is_storage_error(e):
                raise
            raise CheckpointWriteError(f"{self}{key} could not be written again: {reason(e)}") from e

    def read_leaf_metadata(self, leaf: StoredLeaf) -> ts.Future:
        # At most MAX_ZARR_JSON_BYTES + 1 bytes are downloaded: more is refused unparsed.
        read = read_bounded_future(self.open_kvstore(), f"{leaf.path}/zarr.json", MAX_ZARR_JSON_BYTES)
        promise, future = ts.Promise.new()

        def settle(done: ts.Future) -> None:
            try:
                result = done.result()
                promise.set_result(bytes(result.value) if result.state == "value" else None)
            except Exception as e:  # noqa: BLE001 - handed to the reader
                promise.set_exception(e)

        read.add_done_callback(settle)
        return future

    def begin_save(self, paths: list[str], overwrite: bool) -> "ObjectStaging":
        """Take the lease on this place, for a save into a new prefix of its own.

        Nothing committed changes until the commit: the checkpoint being replaced
        stays readable, and is replaced in one conditional write.
        """
        warn_if_not_atomic(self.kvstore)
        store = self.open_kvstore()
        reclaim(store)
        self._check_place(store, overwrite, listing=True)  # refuse before writing anything, if it must be refused
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
        # Created only if still absent; then everything is decided again under the lease.
        name = ARRAYS_PREFIX + uuid.uuid4().hex
        lease = Lease(store, "save", current.stamp.generation, action="save", arrays=[name])
        try:
            base = self._check_place(store, overwrite, listing=False)  # decided again under the lease
            collect_garbage(store)  # what earlier saves that never committed left
        except BaseException:
            lease.release()
            raise
        lease.start_heartbeat()
        return ObjectStaging(self, lease, name, base)

    def _check_place(self, store: ts.KvStore, overwrite: bool, listing: bool) -> Base:
        """Whether a save may write here, and what it commits over.

        Refused: a committed checkpoint without ``overwrite``, one whose manifest is
        damaged (which keys are its cannot be told), and (with ``listing``, which
        lists every key of the place) a place without a manifest that holds
        anything eqxckpt did not write.
        """
        top = read_bounded(store, MANIFEST_NAME, MAX_MANIFEST_BYTES)
        legacy: list[str] = []
        references: list[str] = []
        arrays = ""
        committed = False
        if top.state == "value":
            try:
                old = parse_manifest(bytes(top.value), str(self))
            except ManifestError as e:
                raise CheckpointExistsError(
                    f"The checkpoint at {self} has a damaged manifest, so eqxckpt cannot tell which keys are its; "
                    f"refusing to replace it ({e}). Remove it yourself or save elsewhere."
                ) from None
            # A manifest whose arrays were deleted is no checkpoint: a save replaces it. One
            # beside another save's committed arrays is a damaged checkpoint: only an overwrite does.
            committed = not old.arrays or exists(store, f"{old.arrays}/{COMMIT_NAME}")
            if not committed and not overwrite and (others := _unexplained_commits(store)):
                raise CheckpointExistsError(
                    f"{_damaged(self, old.arrays, others)} Refusing to replace it: delete it yourself, or pass "
                    f"overwrite=True to replace its manifest (leaving {others[0]} for you to remove)."
                )
            if committed and not overwrite:
                raise CheckpointExistsError(
                    f"A checkpoint already exists at {self}. Pass overwrite=True to replace it."
                )
            legacy = [] if old.arrays else old.stored_paths()
            references = old.references()
            arrays = old.arrays
        keys = list_keys(store) if listing else []
        foreign = sorted(set(keys) - _owned_keys(keys, set(legacy)) - {MANIFEST_NAME, LEASE_NAME})
        if foreign and top.state != "value":
            raise CheckpointExistsError(
                f"{self} is not an eqxckpt checkpoint: it holds data that eqxckpt did not write (e.g. "
                f"{foreign[0]!r}, {len(foreign)} keys); refusing to save there. Choose another path."
            )
        return Base(top.stamp.generation, committed, legacy, references, arrays)

    def join_save(self, where: str) -> "ObjectStaging":
        if not is_arrays_name(where):
            raise CheckpointError(f"Process 0 of this save named {where!r} as its prefix, which eqxckpt never makes.")
        return ObjectStaging(self, None, where, None)

    def _groups(self) -> dict[str, set[str]]:
        groups: dict[str, set[str]] = {}
        for key in list_keys(self.open_kvstore()):
            head, _, rest = key.partition("/")
            groups.setdefault(head, set()).add(rest)
        return groups

    def list_entries(self) -> list[tuple[str, str]]:
        # An entry with a lease and no manifest is a save or deletion in progress, or cleanup's to finish.
        return [(head, _state(rests)) for head, rests in sorted(self._groups().items())]

    def clean_leftovers(self, entries: Callable[[str], bool]) -> list[str]:
        left: list[str] = []
        for head, rests in sorted(self._groups().items()):
            if not entries(head):
                continue  # not the caller's: whatever is there is someone else's
            prefixes = {rest.split("/")[0] for rest in rests if is_arrays_name(rest.split("/")[0])}
            if LEASE_NAME in rests:
                reclaim(self.sub(head).open_kvstore())
            elif len(prefixes) > int(_committed(rests)):
                left += [f"{head}/{name}" for name in collect_garbage(self.sub(head).open_kvstore())]
        return left

    def delete(self, keep: Sequence[str] = ()) -> bool:
        store = self.open_kvstore()
        top = read_bounded(store, MANIFEST_NAME, MAX_MANIFEST_BYTES)
        if top.state != "value":
            return True
        try:
            old = parse_manifest(bytes(top.value), str(self))
        except ManifestError:
            return True  # damaged: eqxckpt cannot tell which keys are its, so it leaves them
        current, _ = read_lease(store)
        if current.state == "value":
            return False  # another process is deleting it or saving there: try later
        try:
            lease = Lease(
                store,
                "delete",
                current.stamp.generation,  # only if still absent
                action="delete",
                arrays=[old.arrays] if old.arrays else [],
                paths=[] if old.arrays else old.stored_paths(),
                base=top.stamp.generation,
            )
        except CheckpointBusyError:
            return False
        finish(store, lease.doc)
        lease.release()
        collect_garbage(store)
        self.collect_references(old.references())
        return True

    def read_small(self, name: str, cap: int) -> bytes | None:
        found = read_bounded(self.open_kvstore(), name, cap)
        return bytes(found.value) if found.state == "value" else None

    def create_once(self, name: str, raw: bytes) -> bool:
        warn_if_not_atomic(self.kvstore)  # two creators could both write, where the store only emulates the condition
        return create_if_absent(self.open_kvstore(), name, raw)

    def put_file(self, name: str, pieces: Iterable[Any], overwrite: bool, seen: str | None = None) -> str:
        gathered = bytearray()  # one object, written whole or not at all; each piece copied as it comes
        for piece in pieces:
            gathered += piece
        raw = bytes(gathered)
        del gathered
        store = self.open_kvstore()
        if overwrite and seen is None:
            return store.write(name, raw).result().generation.hex()
        warn_if_not_atomic(self.kvstore)  # two writers could both write, where the store only emulates conditions
        found = stat(store, name)
        if seen:  # still the object there when the directory was taken: nobody took it over since
            written = store.write(name, raw, if_equal=bytes.fromhex(seen)).result()
        elif found.state != "value":  # still none there
            written = store.write(name, raw, if_equal=found.stamp.generation).result()
        else:
            written = None
        if written is None or not written.generation:
            if seen is not None:
                raise CheckpointBusyError(
                    f"{self}{name} changed after this writer took {self}: another writer took it over (this one was "
                    "paused past its lease, or is not eqxckpt). Nothing more is written by this one."
                )
            raise CheckpointExistsError(f"{self}{name} exists; pass overwrite=True to replace it, or write elsewhere.")
        return written.generation.hex()

    def file_stamp(self, name: str) -> str | None:
        found = stat(self.open_kvstore(), name)
        return found.stamp.generation.hex() if found.state == "value" else None

    @contextlib.contextmanager
    def publishing(self) -> Iterator[None]:
        # The lease a save takes on its place (`Lease`), renewed while the files are
        # written: another writer of whole files here is refused until it is released.
        store = self.open_kvstore()
        warn_if_not_atomic(self.kvstore)
        current, doc = read_lease(store)
        if current.state == "value":
            if doc is None:
                raise CheckpointExistsError(
                    f"{self} holds an object named {LEASE_NAME} that eqxckpt did not write; refusing to write there."
                )
            if not is_abandoned(doc):
                raise CheckpointBusyError(
                    f"Another writer holds {self} ({describe_lease(doc)}); wait for it, or write elsewhere. If that "
                    "process died, the place frees itself once the lease times out. Nothing was changed."
                )
        lease = Lease(store, "publish", current.stamp.generation, action=None)
        lease.start_heartbeat()
        try:
            yield
        finally:
            lease.release()

    def remove_file(self, name: str) -> bool:
        store = self.open_kvstore()
        if not exists(store, name):
            return False
        store.write(name, None).result()
        return True

    def file_exists(self, name: str) -> bool:
        return exists(self.open_kvstore(), name)

    def collect_references(self, refs: list[str]) -> None:
        """Delete the sibling prefixes in ``refs`` (what a deleted or replaced checkpoint here
        referred to) where they were kept for it alone (`collect_prefix`)."""
        for ref in refs:
            entry, arrays = parse_reference(ref, str(self))
            collect_prefix(self._sibling(entry).open_kvstore(), arrays)


class ObjectStaging(Staging):
    """A save into a prefix of its own, under a lease; a conditional write of the manifest commits it."""

    def __init__(self, place: ObjectStorage, lease: Lease | None, name: str, base: Base | None):
        self.place = place
        self.storage = ObjectStorage(place.child(name))  # where the arrays go
        self.where = name
        self.lease = lease
        self.base = base
        self.committing = False

    def commit(self, manifest: Manifest, expected: dict[str, int]) -> None:
        """Check the arrays are complete, stage the manifest in the save's prefix, mark
        the lease as committing (on condition that it is still ours: a writer paused past
        its lease stops here), then write the manifest over the one the save began with."""
        lease, base = self.lease, self.base
        assert lease is not None and base is not None
        lease.stop_heartbeat()
        arrays = self.storage.open_kvstore()
        try:
            lease.check()
            check_complete({key: -1 for key in list_keys(arrays)}, expected)
        except CheckpointWriteError:
            lease.check()  # a writer that lost its lease (and its files with it) hears that
            raise
        raw = dataclasses.replace(manifest, arrays=self.where).to_bytes()
        arrays.write(COMMIT_NAME, raw).result()
        retire = [base.arrays] if base.arrays else []
        lease.update(action="commit", base=base.generation.hex(), paths=base.legacy_paths, retire=retire)
        self.committing = True  # from here on, whoever finds the lease abandoned rolls the commit forward
        store = self.place.open_kvstore()
        if not write_manifest(store, raw, base.generation):
            raise CheckpointBusyError(
                f"Another process committed a checkpoint at {self.place} during this save. {NOTHING_COMMITTED}"
            )
        # What the replaced checkpoint held, under the lease that names it: should this
        # process stop here, cleanup finishes it (`finish`).
        delete_leaf_keys(store, base.legacy_paths)
        delete_unheld(store, retire)
        lease.release()
        self.place.collect_references(base.references)  # and what it alone referred to

    def refer(self, refs: list[str]) -> set[str]:
        """Hold each sibling prefix in ``refs`` for this save (`take_hold`); those it may
        refer to. A save that does not commit leaves holds no one sees as live."""
        place = run_store(self.place.open_kvstore())
        if place is None:
            return set()
        run, name = place
        accepted: set[str] = set()
        for ref in refs:
            entry, arrays = parse_reference(ref, str(self.place))
            if take_hold(run, entry, arrays, (name, self.where)):
                accepted.add(ref)
        return accepted

    def abort(self, error: BaseException) -> None:
        """Remove what a failed save wrote: its own prefix, which no other save writes,
        unless the commit had begun. Then the manifest's write either landed (the save
        is committed after all) or did not (the prefix is garbage that the next
        collection removes): both are whole states, so the lease is simply released."""
        lease = self.lease
        if lease is None:
            return
        lease.stop_heartbeat()
        try:
            if not self.committing:
                delete_arrays(lease.store, [self.where])
            lease.release()  # (only if still ours)
        except Exception:  # noqa: BLE001 - the lease stays and times out; cleanup then finishes this
            pass


_PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
_PROBED: set[tuple[str, int]] = set()  # endpoints not refused: probed once per process


def _endpoint(spec: dict[str, Any]) -> tuple[str, str, int] | None:
    """(what, host, port) of the server a kvstore spec talks to; None for the memory store."""
    if spec.get("driver") == "s3":
        what = "S3"
        url = spec.get("endpoint") or environment_endpoint() or "https://s3.amazonaws.com"
    elif spec.get("driver") == "gcs":
        what, url = "Cloud Storage", os.environ.get("TENSORSTORE_GCS_HTTP_URL") or "https://storage.googleapis.com"
    else:
        return None
    parsed = urllib.parse.urlsplit(str(url))
    try:
        port = parsed.port or (80 if parsed.scheme == "http" else 443)
    except ValueError:
        return None  # TensorStore says what is wrong with it
    return (what, parsed.hostname, port) if parsed.hostname else None


def check_reachable(spec: dict[str, Any], where: str) -> None:
    """Fail at once, in one line, when an object store's endpoint certainly cannot be reached
    (its name does not resolve, or it refuses connections), rather than after a minute of
    retries and the AWS library's log lines. Anything less certain (a timeout, a proxy in
    the way) is left to TensorStore and its bounded retries."""
    endpoint = _endpoint(spec)
    if endpoint is None or endpoint[1:] in _PROBED or any(os.environ.get(name) for name in _PROXIES):
        return
    what, host, port = endpoint
    try:
        socket.create_connection((host, port), timeout=3).close()
    except socket.gaierror:
        why = "is a name that does not resolve"
    except ConnectionRefusedError:
        why = "refuses connections"
    except OSError:  # a timeout: not certain, and not asked again (each open would wait)
        _PROBED.add((host, port))
        return
    else:
        _PROBED.add((host, port))
        return
    raise CheckpointError(
        f"Cannot reach {where}: the {what} endpoint {host}:{port} {why}. Check the endpoint ({ENDPOINT_SETTINGS}) "
        "and the network."
    )


def _unexplained_commits(store: ts.KvStore) -> list[str]:
    """The prefixes at ``store`` that hold a committed save's staged manifest, which neither
    the lease names nor eqxckpt retired: arrays that a manifest there should name."""
    keys = set(list_keys(store))
    _, lease = read_lease(store)
    explained = set(lease["arrays"]) | set(lease["retire"]) if lease is not None else set()
    return sorted(
        name
        for name in {key.split("/")[0] for key in keys}
        if is_arrays_name(name)
        and f"{name}/{COMMIT_NAME}" in keys
        and f"{name}/{RETIRED_NAME}" not in keys
        and name not in explained
    )


def _damaged(place: ObjectStorage, named: str, others: list[str]) -> str:
    return (
        f"The checkpoint at {place} has a damaged manifest: it names arrays {named}, which do not exist, while "
        f"{', '.join(others)} there holds a committed save's arrays (a manifest edited, or corrupted in storage)."
    )


def _state(rests: set[str]) -> str:
    """An entry's state (see `Storage.entries`) from its keys, relative to it."""
    if _committed(rests):
        return "committed"
    if LEASE_NAME in rests:
        return "busy"
    # What deleting a checkpoint keeps while newer checkpoints refer to its arrays: marked
    # retired (a copy of a checkpoint, its prefix copied before its manifest, is not).
    prefixes = {rest.split("/")[0] for rest in rests}
    retired = all(is_arrays_name(name) and f"{name}/{RETIRED_NAME}" in rests for name in prefixes)
    return "retired" if rests and retired else "other"


def _committed(rests: set[str]) -> bool:
    """Whether an entry's keys (relative to it) hold a committed checkpoint: a manifest,
    and the staged manifest in a save's prefix (none for checkpoints from before prefixes)."""
    if MANIFEST_NAME not in rests:
        return False
    prefixes = {rest.split("/")[0] for rest in rests if is_arrays_name(rest.split("/")[0])}
    return not prefixes or any(f"{name}/{COMMIT_NAME}" in rests for name in prefixes)


def _owned_keys(keys: list[str], paths: set[str]) -> set[str]:
    """The keys eqxckpt wrote: those of saves' own prefixes, and for the leaves at ``paths``
    of a checkpoint written before prefixes, their zarr.json, chunks and group files."""
    owned = {group_file(group) for group in group_locations(paths)} & set(keys)
    owned |= {key for key in keys if is_arrays_name(key.split("/")[0])}  # saves' own prefixes: reserved names
    for key in keys:
        parts = key.split("/")
        for i, part in enumerate(parts):
            if (part == "c" or (part == "zarr.json" and i == len(parts) - 1)) and "/".join(parts[:i]) in paths:
                owned.add(key)
                break
    return owned
