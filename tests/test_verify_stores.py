"""`verify`'s repair (`eqxckpt._check._repair`) on object stores: moto's S3 and
fake-gcs-server's Cloud Storage, on 127.0.0.1."""

from conftest import assert_trees_equal
from test_verify import _while_repairing, shared_state

import eqxckpt


def _saved_with_a_flipped_bit(store, top: str, steps: int) -> None:
    """A manager's run of ``steps`` steps at ``top``, sharing the frozen leaf of step 0,
    whose chunk then gets a flipped bit."""
    with eqxckpt.CheckpointManager(store.spec(top), max_to_keep=5, blocking=True) as manager:
        for step in range(steps):
            manager.save(step, shared_state(step))
    [key] = [k for k in store.keys(f"{top}0/") if k.endswith("/frozen/c/0")]
    store.put(key, bytes([store.get(key)[0] ^ 1]) + store.get(key)[1:])


def test_repair_rewrites_a_damaged_object_from_the_other_copy(store):
    """On S3 and GCS: the damaged object is written again from the twin, and every step that
    refers to its prefix loads exactly."""
    top = f"repair-{store.name}/run/"
    _saved_with_a_flipped_bit(store, top, 4)
    assert not eqxckpt.verify(store.spec(f"{top}0")).ok
    report = eqxckpt.verify(store.spec(f"{top}0"), repair=True)
    assert report.ok and [path for path, _ in report.mended] == ["frozen"], report
    for step in range(4):
        assert eqxckpt.verify(store.spec(f"{top}{step}")).ok
        assert_trees_equal(eqxckpt.load(store.spec(f"{top}{step}"), shared_state(step)), shared_state(step))


def test_repair_racing_retention_on_an_object_store_creates_nothing(store, monkeypatch):
    """The seventeenth outside attack: retention deletes step 0 (nothing refers to it) after
    repair checked its twin; repair then raised and wrote step 0's chunk back into the
    deleted prefix, where it stayed for ever. An object is written again only where it is
    still there, and a checkpoint gone meanwhile is reported, not raised."""
    top = f"repair-race-{store.name}/run/"
    _saved_with_a_flipped_bit(store, top, 5)

    def retention_deletes_step_0():
        with eqxckpt.CheckpointManager(store.spec(top), max_to_keep=5, blocking=True, incremental=False) as manager:
            manager.save(5, shared_state(5))

    _while_repairing(monkeypatch, retention_deletes_step_0)
    report = eqxckpt.verify(store.spec(f"{top}0"), repair=True)
    assert report.mended == [] and [path for path, _ in report.unmended] == ["frozen"]
    assert store.keys(f"{top}0/") == []
