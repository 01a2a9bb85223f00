"""`CheckpointManager` on object stores (moto's S3 and fake-gcs-server's Cloud Storage,
on 127.0.0.1): retention, incremental steps and their checks where a step is a prefix."""

import re
import time
import warnings

import numpy as np
import pytest
from conftest import assert_trees_equal, manifest_doc
from test_manager import _flip_bit, _rotting_state, tree

import eqxckpt
from eqxckpt._storage._lease import Lease, read_lease
from eqxckpt._storage._objects import ObjectStorage


def test_manager_on_object_stores(store, monkeypatch):
    spec = store.spec("managed/")
    with eqxckpt.CheckpointManager(spec, max_to_keep=2) as manager:
        for step in range(4):
            manager.save(step, tree(step))
    assert manager.all_steps() == [2, 3]
    assert {key.split("/")[1] for key in store.keys("managed/")} == {"2", "3"}
    resumed = eqxckpt.CheckpointManager(spec, max_to_keep=2)  # a restarted job resumes from the latest step
    assert resumed.latest_step() == 3 and resumed.load(tree(0))["w"].tolist() == tree(3)["w"].tolist()
    # Array data with neither a manifest nor a lease, outside a save's prefix, is not
    # provably eqxckpt's: it is skipped with a warning naming it, and never deleted.
    for key in ("managed/9/w/c/0/0", "managed/9/w/zarr.json", "managed/9/zarr.json"):
        store.put(key, b"{}")
    # A save's prefix that no manifest or lease names, and that eqxckpt never retired, is
    # not provably eqxckpt's either (a copy in progress looks the same): named, and kept.
    eqxckpt.save({**spec, "path": "managed/10/"}, tree(10))
    store.delete("managed/10/eqxckpt.json")
    copied = store.keys("managed/10/")
    with pytest.warns(UserWarning) as caught:
        again = eqxckpt.CheckpointManager(spec, max_to_keep=2)
    messages = " ".join(str(w.message) for w in caught)
    assert "9 (no committed checkpoint in it)" in messages
    assert "left alone 1 save prefixes that no lease or manifest beside them explains: 10/%arrays." in messages
    assert again.all_steps() == [2, 3]
    assert store.keys("managed/9/") == ["managed/9/w/c/0/0", "managed/9/w/zarr.json", "managed/9/zarr.json"]
    assert store.keys("managed/10/") == copied
    for key in copied:
        store.delete(key)
    np.testing.assert_array_equal(again.load(tree(0))["w"], np.full((4, 3), 3.0))
    # An abandoned save (its lease's heartbeat older than its timeout) is reclaimed
    # on open: the prefix its lease names, then the lease.
    monkeypatch.setenv("EQXCKPT_LEASE_TIMEOUT_S", "0.01")
    kvstore = ObjectStorage(again.location.child("8")).open_kvstore()
    name = "%arrays." + "8" * 32
    seen = read_lease(kvstore)[0].stamp.generation
    Lease(kvstore, "save", seen, action="save", arrays=[name])  # never renewed nor released
    store.put(f"managed/8/{name}/w/zarr.json", b"{}")
    store.put(f"managed/8/{name}/w/c/0/0", b"half")
    store.put("managed/8/mine.txt", b"not listed")
    time.sleep(0.05)
    with pytest.warns(UserWarning, match="9 "):
        eqxckpt.CheckpointManager(spec, max_to_keep=2)
    assert store.keys("managed/8/") == ["managed/8/mine.txt"]


def test_incremental_saves_on_object_stores_refer_to_unchanged_leaves(store):
    """On an object store a manager's step refers to the unchanged leaves in the step that
    wrote them instead of writing them again. Retention deleting that step keeps what newer
    steps refer to (a retired prefix, which listings skip) and deletes it with the last
    step that refers to it; every step loads and verifies bit-exact meanwhile."""
    rng = np.random.default_rng(1)
    frozen = rng.standard_normal((512, 256)).astype(np.float32)

    def state(step: int, shift: float = 0.0) -> dict:
        adapter = np.full((300, 300), step % 2, np.float32)  # 0, 1, 0, 1: back to an earlier value
        odd = np.zeros(70_000, np.float64 if step >= 3 else np.float32)  # dtype changes at step 3
        small = [np.full(4, i + (step >= 5), np.float32) for i in range(40)]  # packed; changes at step 5
        return {"frozen": frozen + shift, "adapter": adapter, "odd": odd, "small": small, "step": step}

    top = f"incremental-{store.name}/run/"
    run = store.spec(top)

    def written(leaf: str) -> list[str]:  # the steps whose own prefix holds the leaf's array
        return sorted(k[len(top) :].split("/")[0] for k in store.keys(top) if k.endswith(f"/{leaf}/zarr.json"))

    def arrays(step: int) -> dict:
        manifest = manifest_doc(store.get(f"{top}{step}/eqxckpt.json"))
        return {leaf["path"]: leaf.get("arrays") for leaf in manifest["leaves"] if "location" in leaf}

    with eqxckpt.CheckpointManager(run, max_to_keep=3, blocking=False, kept_copies=1) as manager:
        for step in range(6):
            manager.save(step, state(step), force=True)
    assert manager.all_steps() == [3, 4, 5]
    assert written("frozen") == ["0"] and written("odd") == ["0", "3"]  # float64 from 3 on
    assert written("adapter") == ["0", "3", "4", "5"]  # 1, 0, 1: changed each time
    assert written("%packed") == ["0", "5"]  # the small leaves' packed array, taken whole until they change
    assert not any(key.endswith("/0/eqxckpt.json") for key in store.keys(top))  # step 0 is deleted...
    refs = {step: arrays(step) for step in (3, 4, 5)}
    assert {refs[step]["frozen"].split("/")[1] for step in (3, 4, 5)} == {"0"}  # ...but what it wrote is kept
    assert refs[3]["odd"] is None and refs[4]["odd"] == refs[5]["odd"] and refs[5]["odd"].startswith("../3/")
    assert all(refs[step]["adapter"] is None for step in (3, 4, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the retired step 0 is no odd entry
        assert eqxckpt.CheckpointManager(run).all_steps() == [3, 4, 5]
    for step in (3, 4, 5):
        assert eqxckpt.verify(manager.path(step)).ok
        assert_trees_equal(eqxckpt.load(manager.path(step), state(step)), state(step))
    # Keep one step: 3 and 4 go (3's prefix stays for 5's `odd`), then 5.
    with eqxckpt.CheckpointManager(run, max_to_keep=1, blocking=True, kept_copies=1) as manager:
        manager.save(6, state(6))
        assert written("odd") == ["0", "3"] and arrays(6)["odd"] == refs[5]["odd"]
        manager.save(7, state(7, shift=1.0))  # the frozen leaf changes: nothing needs 0's prefix now
    assert manager.all_steps() == [7] and written("frozen") == ["7"] and written("odd") == ["3"]
    assert {key[len(top) :].split("/")[0] for key in store.keys(top)} == {"3", "5", "7"}  # 3, 5 retired; 0 gone
    assert eqxckpt.verify(manager.path(7)).ok
    assert_trees_equal(eqxckpt.load(manager.path(7), state(7, shift=1.0)), state(7, shift=1.0))


@pytest.mark.parametrize("damaged", ["frozen/c/0", "%packed/c/0"])
def test_bit_rot_in_a_base_step_on_an_object_store_is_not_referred_to(store, damaged):
    """The same on an object store: step 1 does not refer to step 0's damaged prefix but
    writes the leaf in its own, and the kept steps load what the caller saved."""
    top = f"rot-{store.name}-{damaged[:3]}/run/"
    with eqxckpt.CheckpointManager(store.spec(top), max_to_keep=2, blocking=True, kept_copies=1) as manager:
        manager.save(0, _rotting_state(0))
        [key] = [k for k in store.keys(f"{top}0/") if k.endswith(f"/{damaged}")]
        store.put(key, _flip_bit(store.get(key)))
        leaf = "frozen" if damaged.startswith("frozen") else "small/"
        with pytest.warns(UserWarning, match=rf"{re.escape(leaf)}.*0"):
            manager.save(1, _rotting_state(1))
        manager.save(2, _rotting_state(2))
        manager.save(3, _rotting_state(3))
    assert manager.all_steps() == [2, 3]
    for step in (2, 3):
        manifest = manifest_doc(store.get(f"{top}{step}/eqxckpt.json"))
        arrays = {r["path"]: r.get("arrays") for r in manifest["leaves"] if "location" in r}
        assert (arrays["frozen" if leaf == "frozen" else "small/0"] or "").startswith(
            "../1/"
        )  # step 1's fresh copy, not step 0's damaged one
        assert eqxckpt.verify(manager.path(step)).ok
        assert_trees_equal(eqxckpt.load(manager.path(step), _rotting_state(step)), _rotting_state(step))


def test_a_manager_that_is_not_incremental_refers_to_nothing_on_an_object_store(store):
    top = f"whole-{store.name}/run/"
    with eqxckpt.CheckpointManager(store.spec(top), blocking=True, incremental=False) as manager:
        for step in range(2):
            manager.save(step, _rotting_state(step))
    for step in range(2):
        manifest = manifest_doc(store.get(f"{top}{step}/eqxckpt.json"))
        assert not [r for r in manifest["leaves"] if r.get("arrays")]  # each leaf in the step's own prefix
        assert_trees_equal(eqxckpt.load(manager.path(step), _rotting_state(step)), _rotting_state(step))


def test_opening_a_run_never_deletes_a_copy_or_a_users_files(store):
    """A copy of step 5 in progress (its prefix copied key by key, its manifest not yet) named
    007, another named 6, and a user's export that uses a prefix's name: no lease or manifest
    beside them names those prefixes, and eqxckpt never retired them, so opening the run
    (a trainer's manager, an evaluator's) leaves every key, and the copies finish loading."""
    top = f"copies-{store.name}/"
    run = store.spec(top)
    with eqxckpt.CheckpointManager(run, blocking=True) as manager:
        manager.save(5, tree(5))
    step5 = sorted(key[len(top) + 2 :] for key in store.keys(top + "5/"))
    for copy in ("007", "6"):
        for key in step5:
            if key != "eqxckpt.json":  # the manifest last: not copied yet
                store.put(f"{top}{copy}/{key}", store.get(f"{top}5/{key}"))
    export = f"{top}exports/%arrays.{'ab' * 16}/weights.bin"
    store.put(export, b"mine")
    before = store.keys(top)
    with pytest.warns(UserWarning) as caught:
        manager = eqxckpt.CheckpointManager(run, max_to_keep=1)
    messages = " ".join(str(w.message) for w in caught)
    assert "007 (not a step number)" in messages and "exports (not a step number)" in messages
    assert "6 (no committed checkpoint in it)" in messages and "left alone 1 save prefixes" in messages
    assert manager.all_steps() == [5]
    assert store.keys(top) == before  # nothing deleted
    for copy in ("007", "6"):  # the copies finish, and load as step 5 does
        store.put(f"{top}{copy}/eqxckpt.json", store.get(f"{top}5/eqxckpt.json"))
        assert_trees_equal(eqxckpt.load({**run, "path": f"{top}{copy}/"}), tree(5))
    # Retention still deletes what is provably its own (a step it replaces), and nothing else.
    manager.save(8, tree(8))
    manager.wait()
    assert manager.all_steps() == [8] and not store.keys(top + "5/")
    assert store.get(export) == b"mine"
    for copy in ("007", "6"):
        assert_trees_equal(eqxckpt.load({**run, "path": f"{top}{copy}/"}), tree(5))
