"""Holds on prefixes: an incremental save on an object store refers to unchanged leaves in
a sibling checkpoint's prefix, and first writes a hold there (``%holds/<entry>/<prefix>``)
so that no deletion removes the prefix while that save, or its checkpoint, may use it.
`delete_unheld` deletes only prefixes with no live hold. The interleavings this is safe
against: docs/concurrency.md ("Incremental saves: holds").
"""

import tensorstore as ts

from .._paths import COMMIT_NAME, DOOMED_NAME, HOLDS_NAME, RETIRED_NAME, is_arrays_name, is_entry_name
from ._kvstore import committed_arrays, delete_arrays, delete_ours, exists, list_keys
from ._lease import read_lease


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
    keys = list_keys(store, start)
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
        doomed, retired = f"{name}/{DOOMED_NAME}", f"{name}/{RETIRED_NAME}"
        delete_ours(store, name, but=(doomed, retired))  # a user's file there stays
        store.write(retired, None).result()  # until now, listings see a retired prefix
        store.write(doomed, None).result()  # last: until now a save that looks sees it doomed
        deleted.append(name)
    return deleted
