"""Cleanup on object stores: finishing what an abandoned lease's holder was doing
(`reclaim`, `finish`), and deleting the retired prefixes that nothing refers to any more
(`collect_garbage`). Why each step is safe: docs/concurrency.md ("Cleanup").
"""

import tensorstore as ts

from .._errors import CheckpointBusyError, ManifestError
from .._manifest import MAX_MANIFEST_BYTES, parse_manifest
from .._paths import COMMIT_NAME, MANIFEST_NAME, RETIRED_NAME, is_arrays_name
from ._holds import delete_unheld
from ._kvstore import (
    committed_arrays,
    delete_arrays,
    delete_leaf_keys,
    list_keys,
    read_bounded,
    stat,
    write_manifest,
)
from ._lease import Lease, is_abandoned, read_lease


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
    if doc is None or not is_abandoned(doc):
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
    listed = {key.split("/")[0] for key in list_keys(store)}
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
