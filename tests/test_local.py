"""The local tier (`eqxckpt._local`) in one process: parts taken and rebuilt, copies
placed, and a `CheckpointManager` resuming from it (its multi-process jobs are in
`test_local_processes.py`)."""

import dataclasses
import decimal
import fractions
import pathlib
import shutil
import struct
import warnings

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings

import eqxckpt
from eqxckpt._local import LocalTier, placement
from eqxckpt._local._directory import run_key
from eqxckpt._storage import resolve
from eqxckpt._write._save import Part

# -- one process's part: an ordinary checkpoint ---------------------------------------------

DTYPES = [np.float32, np.float64, np.int64, np.uint8, np.bool_, ml_dtypes.bfloat16, np.complex64]


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 4), max_size=3).map(tuple),
    scalar=st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.booleans(), st.text(max_size=5)),
)
def test_a_part_restores_every_leaf_bit_exact_through_load(tmp_path_factory, dtype, shape, scalar):
    values = (np.arange(int(np.prod(shape))) * 7 - 3).reshape(shape).astype(dtype)
    tree = {"host": values, "device": jnp.asarray(values), "scalar": scalar, "fn": jax.nn.relu}
    path = tmp_path_factory.mktemp("part") / "p"
    Part(tree).write(path, metadata={})
    out = eqxckpt.load(path, tree)  # an ordinary checkpoint, restored by the one load
    assert out["host"].dtype == values.dtype and out["host"].tobytes() == values.tobytes()
    assert np.asarray(out["device"]).tobytes() == np.asarray(tree["device"]).tobytes()
    assert type(out["scalar"]) is type(scalar)
    assert out["scalar"] == scalar or (scalar != scalar and out["scalar"] != out["scalar"])
    assert out["fn"] is jax.nn.relu
    assert eqxckpt.verify(path).ok and eqxckpt.open(path).paths == ["device", "fn", "host", "scalar"]


def test_a_part_keeps_nan_payloads_complex_and_key_types_as_save_does(tmp_path):
    nan = struct.unpack("<d", struct.pack("<Q", 0xFFF8_0000_0000_1234))[0]
    tree = {"nan": nan, "neg": -0.0, "c": complex(nan, -0.0), "keys": jax.random.split(jax.random.key(1), 3)}
    Part(tree).write(tmp_path / "p", metadata={})
    out = eqxckpt.load(tmp_path / "p", tree)
    bits = lambda x: struct.pack("<d", x)  # noqa: E731
    assert bits(out["nan"]) == bits(nan) and bits(out["neg"]) == bits(-0.0)
    assert bits(out["c"].real) == bits(nan) and bits(out["c"].imag) == bits(-0.0)
    assert jnp.array_equal(jax.random.key_data(out["keys"]), jax.random.key_data(tree["keys"]))
    rbg = {**tree, "keys": jax.random.split(jax.random.key(1, impl="rbg"), 3)}
    with pytest.raises(eqxckpt.StructureMismatchError, match="keys"):  # as eqxckpt.load refuses it
        eqxckpt.load(tmp_path / "p", rbg)


def test_a_part_refuses_a_structure_it_does_not_fit_with_loads_own_rows(tmp_path):
    tree = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    Part(tree).write(tmp_path / "part", metadata={})
    eqxckpt.save(tmp_path / "ckpt", tree)
    like = {"w": jax.ShapeDtypeStruct((3, 2), jnp.float32), "c": jax.ShapeDtypeStruct((3,), jnp.float32)}
    errors = []
    for path in ("part", "ckpt"):
        with pytest.raises(eqxckpt.StructureMismatchError) as caught:
            eqxckpt.load(tmp_path / path, like)
        errors.append(caught.value)
    assert errors[0].missing == errors[1].missing and errors[0].mismatched == errors[1].mismatched
    assert errors[0].unexpected == errors[1].unexpected and errors[0].mismatched


@pytest.mark.parametrize(
    "leaf",
    [b"bytes", fractions.Fraction(1, 3), decimal.Decimal("1.5"), jax.ShapeDtypeStruct((2,), jnp.float32)],
    ids=["bytes", "fraction", "decimal", "shape-dtype-struct"],
)
def test_a_part_refuses_what_save_refuses_with_the_same_error(tmp_path, leaf):
    tree = {"w": jnp.ones(2), "x": leaf}
    with pytest.raises(eqxckpt.UnsupportedLeafError) as by_save:
        eqxckpt.save(tmp_path / "ckpt", tree)
    with pytest.raises(eqxckpt.UnsupportedLeafError) as by_part:
        Part(tree)
    assert str(by_part.value) == str(by_save.value) and "Leaf 'x'" in str(by_part.value)


def test_a_part_refuses_object_arrays_as_save_does(tmp_path):
    with pytest.raises(eqxckpt.CheckpointError) as by_save:
        eqxckpt.save(tmp_path / "ckpt", {"x": np.array([object()])})
    with pytest.raises(type(by_save.value), match="Leaf 'x' has dtype object"):
        Part({"x": np.array([object()])})


# -- where copies go ------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(domains=st.lists(st.sampled_from("abcd"), min_size=1, max_size=12), replicas=st.integers(0, 3))
def test_copies_go_to_other_processes_in_other_domains_first(domains, replicas):
    holders = placement(domains, replicas)
    processes = len(domains)
    count = min(replicas, processes - 1)
    kept = [0] * processes
    for owner, mine in enumerate(holders):
        assert len(mine) == len(set(mine)) == count and owner not in mine
        for holder in mine:
            kept[holder] += 1
        if mine and len(set(domains)) > 1 and domains.count(domains[owner]) <= processes // 2:
            assert domains[mine[0]] != domains[owner]  # one lost domain never takes the first copy too
    assert kept == [count] * processes  # each keeps as many copies as it has kept


def test_placement_example():
    assert placement(["a", "a", "b", "b"], 1) == [[2], [3], [1], [0]]
    assert placement(["h"], 1) == [[]]


# -- a manager with a local tier, in one process --------------------------------------------


def _state(step: int) -> dict:
    return {"w": jnp.arange(6.0).reshape(2, 3) + step, "step": step}


def test_a_manager_resumes_from_its_local_tier_then_from_the_persistent_one(tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    options = dict(save_interval_steps=4, local_path=local, local_interval_steps=1)
    with eqxckpt.CheckpointManager(run, **options) as manager:
        for step in range(7):
            manager.save(step, _state(step))
    like = eqx.filter_eval_shape(lambda: _state(0))
    with eqxckpt.CheckpointManager(run, **options) as manager:
        assert manager.all_steps() == [0, 4] and manager.latest_step() == 6
        out = manager.load(like)
        assert out["step"] == 6 and jnp.array_equal(out["w"], _state(6)["w"])
        assert manager.latest_step() == 6  # at= from the local tier: the leaf alone
        assert jnp.array_equal(manager.load(like["w"], at="w"), _state(6)["w"])
    [tier] = (local / "eqxckpt-local").iterdir()
    assert sorted(p.name for p in (tier / "process-0" / "own").iterdir()) == ["6"]  # the newest one kept
    shutil.rmtree(local)  # the host was replaced: the persistent tier's newest step
    with eqxckpt.CheckpointManager(run, **options) as manager:
        assert manager.latest_step() == 4
        out = manager.load(like)
        assert out["step"] == 4 and jnp.array_equal(out["w"], _state(4)["w"])


def test_a_local_step_restores_a_subtree_at_a_path(tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    with eqxckpt.CheckpointManager(run, save_interval_steps=4, local_path=local, local_interval_steps=1) as manager:
        for step in range(7):
            manager.save(step, _state(step))
    with eqxckpt.CheckpointManager(run, save_interval_steps=4, local_path=local, local_interval_steps=1) as manager:
        assert manager.latest_step() == 6  # a local step: the persistent tier's newest is 4
        w = manager.load(jax.ShapeDtypeStruct((2, 3), jnp.float32), at="w")
        assert jnp.array_equal(w, _state(6)["w"])


def test_a_step_the_persistent_tier_refuses_is_not_saved_locally_either(tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    with eqxckpt.CheckpointManager(run, local_path=local, local_interval_steps=1) as manager:
        manager.save(0, _state(0))
        manager.wait()
        for step, leaf in [(1, fractions.Fraction(1, 3)), (2, b"bytes")]:  # the local tier could hold these
            with pytest.raises(eqxckpt.UnsupportedLeafError):
                manager.save(step, {**_state(step), "extra": leaf})
            manager.wait()
    with eqxckpt.CheckpointManager(run, local_path=local, local_interval_steps=1) as manager:
        assert manager.latest_step() == 0  # not a step a restart could not find persistently
        assert manager.load(_LIKE)["step"] == 0
    with eqxckpt.CheckpointManager(tmp_path / "fresh", local_path=tmp_path / "fresh-local") as manager:
        with pytest.raises(eqxckpt.UnsupportedLeafError):
            manager.save(0, {"extra": fractions.Fraction(1, 3)})
        manager.wait()
        assert manager.latest_step() is None


def test_a_local_tier_older_than_the_persistent_one_is_not_used(tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    with eqxckpt.CheckpointManager(run, save_interval_steps=100, local_path=local, local_interval_steps=1) as manager:
        manager.save(3, _state(3))
    with eqxckpt.CheckpointManager(run) as manager:
        manager.save(5, _state(5))
    with eqxckpt.CheckpointManager(run, local_path=local, local_interval_steps=1) as manager:
        assert manager.latest_step() == 5
        assert manager.load(eqx.filter_eval_shape(lambda: _state(0)))["step"] == 5


def test_the_local_tier_touches_nothing_but_its_own(tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    local.mkdir()
    (local / "notes.txt").write_text("mine")
    tier = LocalTier(local, resolve(run), 0)
    tier.close()  # the manager holds it next
    own = tier.root / "own"
    own.mkdir()
    (own / "007").mkdir()  # not a step name
    (own / "007" / "data").write_text("mine too")
    (own / "12").mkdir()  # no checkpoint in it
    with eqxckpt.CheckpointManager(run, save_interval_steps=100, local_path=local, local_interval_steps=1) as manager:
        for step in range(3):
            manager.save(step, _state(step))
    assert (local / "notes.txt").read_text() == "mine" and (own / "007" / "data").read_text() == "mine too"
    assert sorted(p.name for p in own.iterdir()) == ["007", "12", "2"]


def test_a_piece_of_another_save_of_the_step_is_never_taken(tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    options = dict(save_interval_steps=100, local_path=local, local_interval_steps=1)
    with eqxckpt.CheckpointManager(run, **options) as manager:
        manager.save(2, _state(2))
    tier = LocalTier(local, resolve(run), 0)
    [info] = tier.parts()
    with pytest.raises(eqxckpt.CheckpointError, match="replaced meanwhile"):
        tier.open(dataclasses.replace(info, token="another-save:2"))
    assert eqxckpt.load(tier.open(info), _state(0))["step"] == 2


def test_local_arguments_are_checked(tmp_path):
    with pytest.raises(eqxckpt.ArgumentError, match="local_replicas must be a non-negative int"):
        eqxckpt.CheckpointManager(tmp_path / "run", local_path=tmp_path / "l", local_replicas=-1)
    with pytest.raises(eqxckpt.ArgumentError, match="local_max_to_keep must be a positive int"):
        eqxckpt.CheckpointManager(tmp_path / "run", local_path=tmp_path / "l", local_max_to_keep=0)
    with pytest.raises(eqxckpt.ArgumentError, match="directory of this host"):
        eqxckpt.CheckpointManager(tmp_path / "run", local_path="s3://bucket/x")


# -- attack 11: a manager with a local tier, in one process ---------------------------------

_LIKE = {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32), "step": 0}


def _local_options(local: pathlib.Path, **more) -> dict:
    return dict(save_interval_steps=4, local_path=local, local_interval_steps=1, **more)


def _own_steps(local: pathlib.Path) -> list[str]:
    [tier] = (local / "eqxckpt-local").iterdir()
    return sorted(p.name for p in (tier / "process-0" / "own").iterdir())


def test_a_refused_second_save_of_a_step_leaves_the_local_tier_as_it_was(tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        manager.save(4, _state(4))
        manager.wait()
        with pytest.raises(eqxckpt.CheckpointExistsError):
            manager.save(4, _state(99))  # refused: step 4 is saved already
        manager.wait()
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        assert manager.latest_step() == 4
        out = manager.load(_LIKE)
        # Step 4 is what was saved as step 4 (persistent step 4 holds it), not the refused save's values.
        assert out["step"] == 4 and jnp.array_equal(out["w"], _state(4)["w"])


def test_load_of_a_local_step_by_number_restores_it(tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        for step in range(7):
            manager.save(step, _state(step))
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        # The step latest_step() would name, asked for by number (e.g. from a log) without calling it first.
        out = manager.load(_LIKE, step=6)
        assert out["step"] == 6 and jnp.array_equal(out["w"], _state(6)["w"])


def test_load_after_more_saves_restores_the_newest_step_not_an_earlier_answer(tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        for step in range(7):
            manager.save(step, _state(step))
        manager.wait()
        assert manager.latest_step() == 6  # asked, e.g. for a log line
        for step in range(7, 10):
            manager.save(step, _state(step))
        manager.wait()
        out = manager.load(_LIKE)  # the latest: step 9 (local), the newest one saved
        assert out["step"] == 9 and jnp.array_equal(out["w"], _state(9)["w"])


def test_a_failing_local_tier_never_stops_the_persistent_save(tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        manager.save(0, _state(0))
        manager.wait()
        # The local disk breaks (here: its directory is no longer one).
        [tier] = (local / "eqxckpt-local").iterdir()
        shutil.rmtree(tier / "process-0" / "own")
        (tier / "process-0" / "own").write_text("not a directory")
        try:
            manager.save(4, _state(4))
            manager.wait()
        except eqxckpt.CheckpointError:
            pass  # the local tier may say it failed, but...
        # ...the durable copy of step 4 is saved all the same.
        assert manager.all_steps() == [0, 4]
        out = manager.load(_LIKE, step=4)
        assert out["step"] == 4 and jnp.array_equal(out["w"], _state(4)["w"])


def _saved(tmp_path: pathlib.Path, steps: int) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    """Steps ``0..steps-1`` saved by a manager with a local tier: the run, the local path,
    and the directory of process 0's own parts."""
    run, local = tmp_path / "run", tmp_path / "local"
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        for step in range(steps):
            manager.save(step, _state(step))
    [tier] = (local / "eqxckpt-local").iterdir()
    return run, local, tier / "process-0" / "own"


def test_a_corrupt_local_piece_falls_back_to_the_persistent_step(tmp_path):
    run, local, own = _saved(tmp_path, 7)
    piece = own / "6"
    chunks = [p for p in piece.rglob("*") if p.is_file() and "c" in p.relative_to(piece).parts]
    assert chunks
    for chunk in chunks:  # bit rot in the one local step kept
        data = bytearray(chunk.read_bytes())
        data[-1] ^= 1
        chunk.write_bytes(bytes(data))
    damaged = {chunk.relative_to(piece): chunk.read_bytes() for chunk in chunks}
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        # Its manifest reads: latest_step names it (without reading every chunk first). The
        # load finds the damage as it reads, sets the part aside and raises, naming the step;
        # never a different step than the one latest_step named.
        assert manager.latest_step() == 6
        with pytest.warns(UserWarning, match="Local tier: .* is damaged"):
            with pytest.raises(eqxckpt.CorruptCheckpointError, match="step 6 cannot be restored.*latest_step"):
                manager.load(_LIKE)
        # Not stuck on step 6 forever: the newest step that can be read, the persistent step 4.
        start = manager.latest_step()
        out = manager.load(_LIKE)
        assert start == 4 and out["step"] == 4 and jnp.array_equal(out["w"], _state(4)["w"])
    # Set aside, not deleted: eqxckpt deletes nothing it cannot prove it wrote intact.
    [aside] = piece.parent.glob(".6.set-aside-*")
    assert all((aside / name).read_bytes() == data for name, data in damaged.items()) and not piece.exists()


def test_a_leaf_the_local_tier_cannot_hold_is_never_taken_from_like(tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    tree = {"w": jnp.ones(2), "shift": 1 + 2j}  # a Python complex: the persistent tier keeps it
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        for step in (4, 5):
            manager.save(step, tree)
    like = {"w": jax.ShapeDtypeStruct((2,), jnp.float32), "shift": 0j}
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        assert manager.load(like, step=4)["shift"] == 1 + 2j
        assert manager.latest_step() == 5
        assert manager.load(like)["shift"] == 1 + 2j  # not like's 0j


def test_host_leaves_and_scalars_that_do_not_fit_like_are_refused(tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    tree = {"h": np.arange(3, dtype=np.float32), "n": 5, "w": jnp.ones(2)}
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        for step in (4, 5):
            manager.save(step, tree)
    like = {"h": np.zeros(5, np.int32), "n": 1.5, "w": jax.ShapeDtypeStruct((2,), jnp.float32)}
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        with pytest.raises(eqxckpt.StructureMismatchError):
            manager.load(like, step=4)  # the persistent tier refuses it
        assert manager.latest_step() == 5
        with pytest.raises(eqxckpt.StructureMismatchError, match=r"(?s)\bh: expected int32.*\bn: expected float"):
            manager.load(like)  # so must the local tier, naming both leaves


def test_local_max_to_keep_counts_the_steps_of_an_earlier_run(tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    options = _local_options(local, local_max_to_keep=2)
    with eqxckpt.CheckpointManager(run, **options) as manager:
        for step in range(7):
            manager.save(step, _state(step))
    assert _own_steps(local) == ["5", "6"]
    with eqxckpt.CheckpointManager(run, **options) as manager:
        assert manager.latest_step() == 6
        assert manager.load(_LIKE)["step"] == 6
        manager.save(7, _state(7))
    assert _own_steps(local) == ["6", "7"]  # the two newest complete steps, not one


def test_a_second_live_manager_on_one_local_path_and_process_is_refused(tmp_path):
    # Two managers on one local_path and process index would delete each other's parts
    # (attack 11, finding 11): the second is refused while the first holds the directory.
    run, local = tmp_path / "run", tmp_path / "local"
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as trainer:
        for step in range(7):
            trainer.save(step, _state(step))
        with pytest.raises(eqxckpt.ArgumentError, match="Another live CheckpointManager holds the local tier"):
            eqxckpt.CheckpointManager(run, **_local_options(local))
        with eqxckpt.CheckpointManager(run) as evaluator:  # without the local tier: allowed
            assert evaluator.latest_step() == 4
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:  # released at close
        assert manager.latest_step() == 6 and manager.load(_LIKE)["step"] == 6


def test_a_leaf_the_local_tier_cannot_store_is_named_by_its_path_at_save(tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    with eqxckpt.CheckpointManager(run, save_interval_steps=100, local_path=local, local_interval_steps=1) as manager:
        # Refused by save itself (as the persistent tier's save does), naming the leaf.
        with pytest.raises(eqxckpt.CheckpointError, match="Leaf 'names'"):
            manager.save(1, {"w": jnp.ones(2), "names": np.array(["ab", "c"])})


# -- four processes --------------------------------------------------------------------------


# -- the numbered failures of the local tier built beside the pipeline (issue 51) ------------


def _persistent_and_local(tmp_path: pathlib.Path, tree: dict, like: dict, **load_kwargs) -> tuple:
    """``tree`` saved as step 4 (both tiers) and 5 (the local tier alone); what each tier restores."""
    run, local = tmp_path / "run", tmp_path / "local"
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        for step in (4, 5):
            manager.save(step, tree)
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        persistent = manager.load(like, step=4, **load_kwargs)
        assert manager.latest_step() == 5
        return persistent, manager.load(like, **load_kwargs)


def test_python_floats_keep_their_nan_payload_sign_and_complex_parts_in_the_local_tier(tmp_path):
    nan = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_0000_BEEF))[0]
    tree = {"w": jnp.ones(2), "nan": nan, "neg": -0.0, "c": complex(-0.0, nan)}
    persistent, local = _persistent_and_local(tmp_path, tree, tree)
    bits = lambda x: struct.pack("<d", x)  # noqa: E731
    for out in (persistent, local):
        assert bits(out["nan"]) == bits(nan) and bits(out["neg"]) == bits(-0.0)
        assert bits(out["c"].real) == bits(-0.0) and bits(out["c"].imag) == bits(nan)


def test_a_float64_leaf_with_x64_off_comes_back_as_the_persistent_tier_gives_it(tmp_path):
    exact = np.array([1 + 2**-40, -3.5], np.float64)  # not a float32
    tree = {"h": exact}
    like = {"h": jax.ShapeDtypeStruct((2,), np.float64)}
    persistent, local = _persistent_and_local(tmp_path, tree, like)
    assert type(local["h"]) is type(persistent["h"]) and local["h"].dtype == np.float64
    assert np.asarray(local["h"]).tobytes() == exact.tobytes()


def _refusals_of_both(tmp_path: pathlib.Path, tree: dict, like: dict) -> tuple:
    """``tree`` saved as step 4 (both tiers) and 5 (the local tier alone); the
    `StructureMismatchError` each tier raises for ``like``."""
    run, local = tmp_path / "run", tmp_path / "local"
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        for step in (4, 5):
            manager.save(step, tree)
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        with pytest.raises(eqxckpt.StructureMismatchError) as by_persistent:
            manager.load(like, step=4)
        assert manager.latest_step() == 5
        with pytest.raises(eqxckpt.StructureMismatchError) as by_local:
            manager.load(like)
    return by_persistent.value, by_local.value


def test_rbg_keys_are_refused_for_saved_threefry_keys_by_the_local_tier_as_by_load(tmp_path):
    tree = {"k": jax.random.split(jax.random.key(3), 2)}
    rbg = {"k": jax.random.split(jax.random.key(3, impl="rbg"), 2)}
    by_persistent, by_local = _refusals_of_both(tmp_path, tree, rbg)
    assert by_local.mismatched == by_persistent.mismatched and by_local.mismatched


def test_a_local_restore_lands_in_pinned_host_memory(tmp_path):
    tree = {"opt": jnp.arange(12.0).reshape(3, 4)}
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    like = {"opt": jax.ShapeDtypeStruct((3, 4), jnp.float32, sharding=sharding)}
    persistent, local = _persistent_and_local(tmp_path, tree, like)
    for out in (persistent, local):
        assert out["opt"].sharding == sharding and np.array_equal(np.asarray(out["opt"]), np.asarray(tree["opt"]))


def test_a_local_restore_into_a_wrong_shape_has_the_rows_of_load(tmp_path):
    tree = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3), "n": 1}
    like = {"w": jax.ShapeDtypeStruct((3, 2), jnp.float32), "c": jax.ShapeDtypeStruct((3,), jnp.float32), "n": 1}
    by_persistent, by_local = _refusals_of_both(tmp_path, tree, like)
    for rows in ("missing", "unexpected", "mismatched"):
        assert getattr(by_local, rows) == getattr(by_persistent, rows) != []


def test_a_local_restore_takes_at_like_load(tmp_path):
    tree = {"model": {"w": jnp.arange(6.0).reshape(2, 3)}, "opt": {"mu": jnp.zeros((2, 3))}}
    model = {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)}
    persistent, local = _persistent_and_local(tmp_path, tree, model, at="model")
    assert jnp.array_equal(local["w"], tree["model"]["w"]) and jnp.array_equal(persistent["w"], local["w"])


def test_a_symlinked_directory_of_parts_is_never_followed(tmp_path):
    # Attack 11, finding 9 (retention deleted a backup's copies through the link), and the
    # attack on this change (saves were written through it): a symlinked `own` is refused.
    run, local, backup = tmp_path / "run", tmp_path / "local", tmp_path / "backup"
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        manager.save(1, _state(1))
    [tier] = (local / "eqxckpt-local").iterdir()
    own = tier / "process-0" / "own"
    shutil.copytree(own, backup)  # the user's backup of the parts: step 1
    (backup / "notes.txt").write_text("mine")
    shutil.rmtree(own)
    own.symlink_to(backup)
    with pytest.raises(eqxckpt.ArgumentError, match="symlink"):
        eqxckpt.CheckpointManager(run, **_local_options(local))
    assert sorted(p.name for p in backup.iterdir()) == ["1", "notes.txt"] and own.is_symlink()
    # A peer's directory that is a link is never written or deleted through either.
    own.unlink()
    (tier / "process-0" / "peer-1").symlink_to(backup)
    with pytest.warns(UserWarning, match="not a directory of its own"):
        with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
            for step in range(2, 5):
                manager.save(step, _state(step))
    assert sorted(p.name for p in backup.iterdir()) == ["1", "notes.txt"]


def test_a_second_manager_on_the_run_spelled_through_a_symlink_is_refused(tmp_path):
    # The attack on this change: the lock named the run as spelled, so a second live manager
    # on `run-link -> run` with the same local_path was accepted.
    run, local = tmp_path / "run", tmp_path / "local"
    (tmp_path / "run-link").symlink_to(run, target_is_directory=True)
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        manager.save(1, _state(1))
        with pytest.raises(eqxckpt.ArgumentError, match="Another live CheckpointManager"):
            eqxckpt.CheckpointManager(tmp_path / "run-link", **_local_options(local))


@pytest.mark.parametrize("where", ["file", "under-a-file", "nul", "proc", "empty"])
def test_a_bad_local_path_is_an_argument_error_naming_it(tmp_path, where):
    (tmp_path / "file").write_text("x")
    path = {
        "file": tmp_path / "file",
        "under-a-file": tmp_path / "file" / "local",
        "nul": f"{tmp_path}/lo\0cal",
        "proc": "/proc/eqxckpt-local-test",
        "empty": "",
    }[where]
    with pytest.raises(eqxckpt.ArgumentError, match="local_path"):
        eqxckpt.CheckpointManager(tmp_path / "run", local_path=path)


def test_local_replicas_no_peer_can_hold_are_warned_about(tmp_path):
    with pytest.warns(UserWarning, match="local_replicas=2 asks for more copies"):
        with eqxckpt.CheckpointManager(tmp_path / "run", local_path=tmp_path / "l", local_replicas=2):
            pass


def test_the_tiers_of_one_bucket_path_on_two_endpoints_are_apart():
    spec = {"driver": "s3", "bucket": "b", "path": "run/"}
    one = resolve({**spec, "endpoint": "http://127.0.0.1:9000"})
    other = resolve({**spec, "endpoint": "http://127.0.0.1:9001"})
    assert str(one) == str(other) and run_key(one) != run_key(other)


def test_a_deleted_run_is_never_resumed_from_its_local_tier(tmp_path):
    run, local = tmp_path / "run", tmp_path / "local"
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        for step in range(11):
            manager.save(step, _state(step))
    shutil.rmtree(run)  # starting afresh
    with pytest.warns(UserWarning, match="another or a deleted run"):
        with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
            assert manager.all_steps() == [] and manager.latest_step() is None
            # A new run reaches step 10 at the same path: one state under one step number.
            for step in range(11):
                manager.save(step, _state(100 + step))
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        assert manager.latest_step() == 10
        local_ten, persistent_ten = manager.load(_LIKE), manager.load(_LIKE, step=8)
    assert jnp.array_equal(local_ten["w"], _state(110)["w"]) and persistent_ten["step"] == 108


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 100), max_size=12), budget=st.integers(1, 150))
def test_a_part_is_offered_in_groups_within_the_budget_in_order(sizes, budget):
    from eqxckpt._local._checkpoints import _groups

    files = [(f"f{i}", np.zeros(n, np.uint8)) for i, n in enumerate(sizes)]
    groups = _groups(files, budget)
    assert [key for group in groups for key, _ in group] == [key for key, _ in files]  # each once, in order
    for group in groups:  # within the budget, or one file larger than it alone
        assert sum(data.nbytes for _, data in group) <= budget or len(group) == 1


def test_a_local_path_that_is_the_run_itself_is_no_entry_of_the_run(tmp_path):
    # The last outside attack: a manager on a run whose local tier is in the run's own
    # directory warned, at every open, that `eqxckpt-local` is not a committed step.
    run = tmp_path / "run"
    with eqxckpt.CheckpointManager(run, **_local_options(run)) as manager:
        for step in range(6):
            manager.save(step, _state(step))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning about eqxckpt's own directory
        with eqxckpt.CheckpointManager(run, **_local_options(run)) as manager:
            assert manager.all_steps() == [0, 4] and manager.latest_step() == 5
            assert jnp.array_equal(manager.load(_LIKE)["w"], _state(5)["w"])


def test_a_step_saved_again_moves_aside_a_part_holding_files_eqxckpt_did_not_write(tmp_path):
    """The sixth outside attack: a user's file in a part's leaf directory (and a stray chunk
    file) were deleted when the step was saved again after a restart; a part is replaced
    only if it holds exactly what its save wrote, and is otherwise renamed aside."""
    run, local, own = _saved(tmp_path, 2)
    part = own / "1"
    assert eqxckpt.open(part).stored.unwritten() == []
    (part / "w" / "notes.txt").write_text("mine")
    (part / "w" / "c" / "7").write_bytes(b"stray")
    assert eqxckpt.open(part).stored.unwritten() == ["w/c/7", "w/notes.txt"]
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        with pytest.warns(UserWarning, match=r"held files eqxckpt did not write \(w/c/7\)"):
            manager.save(1, _state(10))  # a restart that saves step 1 again, without a load
            manager.wait()
    [aside] = part.parent.glob(".1.set-aside-*")
    assert (aside / "w" / "notes.txt").read_text() == "mine" and (aside / "w" / "c" / "7").read_bytes() == b"stray"
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        assert manager.latest_step() == 1 and manager.load(_LIKE)["w"].tolist() == _state(10)["w"].tolist()


def test_a_part_deleted_while_it_is_sent_is_gone_not_damaged(tmp_path):
    """The sixth outside attack: a copy deleted meanwhile was reported (and handled) as
    damaged; it is gone (`CheckpointNotFoundError`, which a restore meets with
    `CheckpointChangedError` after latest_step named it)."""
    run, local = tmp_path / "run", tmp_path / "local"
    with eqxckpt.CheckpointManager(run, **_local_options(local)) as manager:
        manager.save(0, _state(0))
    tier = LocalTier(local, resolve(run), 0)
    try:
        [info] = tier.parts()
        assert [key for key, _ in tier.files(info)][-1] == "eqxckpt.json"
        shutil.rmtree(tier.root / "own" / "0")
        with pytest.raises(eqxckpt.CheckpointNotFoundError, match="deleted meanwhile"):
            tier.files(info)
    finally:
        tier.close()
