"""`ObjectStorage`: checkpoints under a prefix of an object store (S3, GCS, memory).

A save takes a lease object, writes its leaves, and commits by writing the
manifest last, on condition that none exists (see `_lease`).
"""

import bisect
import dataclasses
from typing import Any

import tensorstore as ts

from ._backend import ENDPOINT_SETTINGS, NOTHING_COMMITTED, Pin, Staging, Storage, check_complete
from ._errors import (
    CheckpointBusyError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    ManifestError,
)
from ._leaf import StoredLeaf
from ._lease import (
    Lease,
    StorePin,
    delete_leaf_keys,
    describe_lease,
    is_stale,
    read_lease,
    reclaim,
    uncommit,
    warn_if_not_atomic,
)
from ._manifest import MAX_MANIFEST_BYTES, Manifest, parse_manifest
from ._paths import LEASE_NAME, MANIFEST_NAME, group_file, group_locations
from ._store import (
    is_storage_error,
    reason,
)


@dataclasses.dataclass(frozen=True)
class ObjectStorage(Storage):
    """A checkpoint under a prefix of an object store (or TensorStore's memory store)."""

    def sub(self, name: str) -> "ObjectStorage":
        return ObjectStorage(self.child(name))

    def argument(self) -> dict[str, Any]:
        return dict(self.kvstore)

    def __str__(self) -> str:
        spec = self.kvstore
        scheme = {"gcs": "gs"}.get(spec["driver"], spec["driver"])  # as users write it: gs://bucket/path
        return f"{scheme}://{spec.get('bucket', '')}/{spec.get('path', '')}".replace(":///", "://")

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
                f"Cannot read {self}: {reason(e)}. Check the endpoint ({ENDPOINT_SETTINGS}), the network and the "
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
        clash = sorted({group_file(group) for group in group_locations(paths)} & set(foreign))
        if clash:
            raise CheckpointExistsError(
                f"{self} holds data that eqxckpt did not write where it keeps a zarr group's metadata "
                f"({clash[0]!r}); refusing to save over it. Choose another path."
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
        check_complete({k.decode("utf-8", "replace"): -1 for k in store.list().result()}, expected)
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
    """The keys eqxckpt wrote for the leaves at ``paths`` (their zarr.json and chunks, and
    the group files above them)."""
    owned = {group_file(group) for group in group_locations(paths)} & set(keys)
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
