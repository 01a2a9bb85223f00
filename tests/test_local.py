"""The local tier (`eqxckpt._local`): parts taken and rebuilt, copies placed, and a
`CheckpointManager` resuming from it: in one process, and in four real JAX processes
on 127.0.0.1 whose local tiers are wiped, killed mid-save, stale or shared."""

import dataclasses
import decimal
import fractions
import json
import os
import pathlib
import shutil
import signal
import struct
import subprocess
import sys
import time
import warnings

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import WORKERS, launch, start_workers
from hypothesis import given, settings

import eqxckpt
from eqxckpt._local import LocalTier, placement
from eqxckpt._local._directory import run_key
from eqxckpt._storage import resolve
from eqxckpt._write._save import Part

WORKER = WORKERS / "local_tier_worker.py"


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


@pytest.mark.multiprocess
def test_a_preemption_notice_saves_to_the_local_tier_then_the_persistent_one(tmp_path):
    # In a process of its own: the notice is a real SIGTERM to it.
    script = f"""
import os, signal
import numpy as np
import eqxckpt
with eqxckpt.CheckpointManager({str(tmp_path / "run")!r}, save_interval_steps=100, local_path={str(tmp_path / "local")!r},
                               local_interval_steps=10, exit_on_preemption=False) as manager:
    manager.save(0, {{"w": np.zeros(3)}})
    os.kill(os.getpid(), signal.SIGTERM)
    manager.save(3, {{"w": np.full(3, 3.0)}})  # neither interval saves step 3: the notice does
    print("preempted", manager.reached_preemption(3), manager.all_steps(), flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["preempted True [0, 3]"]
    assert _own_steps(tmp_path / "local") == ["3"]  # the local tier has it too (kept: the newest)
    with eqxckpt.CheckpointManager(tmp_path / "run", local_path=tmp_path / "local", local_interval_steps=10) as manager:
        assert manager.latest_step() == 3
        assert np.array_equal(manager.load({"w": np.zeros(3)})["w"], np.full(3, 3.0))


# -- four processes --------------------------------------------------------------------------


def _resumed(logs: list[str]) -> list[tuple[str, int]]:
    """Each process's ``RESUMED <step> <elements checked>``."""
    out = []
    for log in logs:
        [line] = [line for line in log.splitlines() if line.startswith("RESUMED")]
        _, step, checked = line.split()
        out.append((step, int(checked)))
    return out


def _train(tmp_path: pathlib.Path, until: int, **env: str) -> list[tuple[str, int]]:
    return _resumed(launch("train", 4, tmp_path, worker=WORKER, LOCAL_UNTIL=str(until), **env))


def _hidden(tmp_path: pathlib.Path) -> list[str]:
    """What interrupted local saves left (hidden staging entries) in the local tiers."""
    return [str(p) for p in tmp_path.glob("host*/eqxckpt-local/*/process-*/*/.*")]


def _killed(tmp_path: pathlib.Path, fault: str, until: int) -> list[tuple[str, int]]:
    """Run the job until ``fault`` SIGKILLs its victim, then stop the others (as a scheduler
    would); what each process resumed from (`_resumed`)."""
    victim, where, at = fault.split(":")
    workers, logs = start_workers(
        WORKER, "train", 4, tmp_path, EQXCKPT_BARRIER_TIMEOUT_S="60", LOCAL_UNTIL=str(until), LOCAL_FAULT=fault
    )
    try:
        assert workers[int(victim)].wait(timeout=120) == -signal.SIGKILL
        assert f"KILLED in {where} {at}" in logs[int(victim)].read_text()
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
    assert all(f"SAVED {at}" not in log.read_text() for log in logs)
    return _resumed([log.read_text() for log in logs])


@pytest.mark.multiprocess
def test_four_processes_killed_in_local_saves_wiped_and_resumed_lose_no_complete_step(tmp_path):
    # A job of four processes, persistent steps every 4, a local step every step (each
    # process's part also kept by its peer). Process 1 is SIGKILLed three times and the job
    # stopped and restarted each time: committing its own part of step 3, committing the copy
    # of process 0's part of step 5 it keeps, and just after offering its part of step 7 as
    # process 2 fetches it. A step is whole only if every process's part of it was kept (by
    # itself or its peer): each restart resumes from the step before the one killed, or from
    # that one, in every process alike, bit-exact; never a mix.
    assert _killed(tmp_path, "1:own:3", 9) == [("None", 0)] * 4
    for fault, before in (("1:copy:5", 3), ("1:offer:7", 5)):
        resumed = _killed(tmp_path, fault, 9)
        steps = {step for step, _ in resumed}
        assert len(steps) == 1 and steps <= {str(before - 1), str(before)}, resumed
        assert all(checked > 0 for _, checked in resumed)
    # A replaced host: every process resumes from step 6 or 7, the new one from its peer's copy.
    shutil.rmtree(tmp_path / "host2")
    resumed = _train(tmp_path, 9)
    steps = {step for step, _ in resumed}
    assert len(steps) == 1 and steps <= {"6", "7"} and all(checked > 0 for _, checked in resumed)
    assert list((tmp_path / "host2").glob("eqxckpt-local/*/process-2/own/8"))  # its own part again
    assert _hidden(tmp_path) == []  # what the killed saves left was cleaned up
    # Three hosts lost with every copy of their parts: the newest persistent step, 8.
    for host in (1, 2, 3):
        shutil.rmtree(tmp_path / f"host{host}")
    resumed = _train(tmp_path, 9)
    assert [step for step, _ in resumed] == ["8"] * 4 and all(checked > 0 for _, checked in resumed)


@pytest.mark.multiprocess
@pytest.mark.parametrize("store", ["s3", "gcs"])
def test_four_processes_resume_from_peers_then_from_an_object_store(tmp_path, store, request):
    from conftest import ObjectStore

    server = ObjectStore("s3", *request.getfixturevalue("s3")) if store == "s3" else request.getfixturevalue("gcs")
    spec = json.dumps(server.spec(f"local-{os.getpid()}-{time.monotonic_ns()}/"))
    # Persistent step 0 on the object store; local steps 0..3.
    assert _train(tmp_path, 4, LOCAL_STORE=spec) == [("None", 0)] * 4
    shutil.rmtree(tmp_path / "host2")  # a replaced host: every process resumes from step 3, bit-exact
    resumed = _train(tmp_path, 5, LOCAL_STORE=spec)
    assert [step for step, _ in resumed] == ["3"] * 4 and all(checked > 0 for _, checked in resumed)
    assert list((tmp_path / "host2").glob("eqxckpt-local/*/process-2/own/4"))  # its own part again
    # Three hosts lost with every copy of their parts: the newest persistent step, 4.
    for host in (1, 2, 3):
        shutil.rmtree(tmp_path / f"host{host}")
    resumed = _train(tmp_path, 5, LOCAL_STORE=spec)
    assert [step for step, _ in resumed] == ["4"] * 4 and all(checked > 0 for _, checked in resumed)


@pytest.mark.multiprocess
def test_two_copies_of_each_part_restore_a_step_whose_owner_and_first_keeper_are_lost(tmp_path):
    """``local_replicas=2`` with four processes (the seventh outside attack: every local
    save hung at its copy phase, as each offer could be pulled by one peer only). Hosts 0
    and 2 lost: process 0's part comes from its second keeper, process 1, bit-exact."""
    assert _train(tmp_path, 4, LOCAL_REPLICAS="2") == [("None", 0)] * 4
    assert len(list(tmp_path.glob("host*/eqxckpt-local/*/process-*/peer-*/3"))) == 8  # two copies of each part
    for host in (0, 2):
        shutil.rmtree(tmp_path / f"host{host}")
    resumed = _train(tmp_path, 5, LOCAL_REPLICAS="2")
    assert [step for step, _ in resumed] == ["3"] * 4 and all(checked > 0 for _, checked in resumed)


@pytest.mark.multiprocess
def test_a_stale_host_at_another_step_in_a_shared_directory_is_never_mixed_in(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "notes.txt").write_text("someone else's")
    # An older run (seed 1) in the same places reaches step 4; process 2's tier is kept aside.
    _train(tmp_path, 5, LOCAL_HOSTS="shared", LOCAL_SEED="1", LOCAL_KEEP="2")
    [run_tier] = (shared / "eqxckpt-local").iterdir()
    stale = tmp_path / "stale"
    shutil.copytree(run_tier / "process-2", stale)
    # A new run (seed 2) from scratch reaches step 3; then process 2 comes back with the old tier.
    shutil.rmtree(tmp_path / "run")
    shutil.rmtree(shared / "eqxckpt-local")
    _train(tmp_path, 4, LOCAL_HOSTS="shared", LOCAL_SEED="2", LOCAL_KEEP="2")
    shutil.rmtree(run_tier / "process-2")
    shutil.copytree(stale, run_tier / "process-2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tier = LocalTier(shared, resolve(tmp_path / "run"), 2)
        old = {info.token for info in tier.parts()}
        tier.close()  # process 2's manager holds it next
    # Its step 4 is no step of this run, nor its step 3: step 3 of seed 2, with process 2's part from its peer.
    resumed = _train(tmp_path, 5, LOCAL_HOSTS="shared", LOCAL_SEED="2", LOCAL_KEEP="2")
    assert [step for step, _ in resumed] == ["3"] * 4 and all(checked > 0 for _, checked in resumed)
    assert (shared / "notes.txt").read_text() == "someone else's"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tier = LocalTier(shared, resolve(tmp_path / "run"), 2)
        parts = tier.parts()
    assert sorted({info.step for info in parts}) == [3, 4] and not old & {info.token for info in parts}


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


@pytest.mark.multiprocess
def test_four_processes_never_resume_a_deleted_or_replaced_run_nor_onto_another_mesh(tmp_path):
    # Run 0 reaches step 6 (persistent steps 0 and 4), each process's local tier on its own host.
    _train(tmp_path, 7)
    # Each part is an ordinary checkpoint of the tree's own leaves: a sharded leaf records the
    # one block of it that process 1 holds (2 of 8 rows), a replicated one is whole.
    [manifest] = (tmp_path / "host1").glob("eqxckpt-local/*/process-1/own/6/eqxckpt.json")
    leaves = {leaf["path"]: leaf for leaf in json.loads(manifest.read_text())["leaves"]}
    assert leaves["params/w"]["blocks"] == [[[2, 4], [0, 1024]]] and leaves["keys"]["blocks"] == [[[1, 2], [0, 2]]]
    assert "blocks" not in leaves["replicated"] and leaves["step"]["value"] == 6
    assert eqxckpt.verify(manifest.parent).ok
    # Two chunk files of the same size swapped in process 1's part (each still passes its
    # CRC-32C): the digest over the blocks it holds catches it, and process 1 resumes from
    # its peer's copy, bit-exact (the outside attack on this change found it restored silently).
    [w] = manifest.parent.glob("params/w/c/*/*")
    [v] = manifest.parent.glob("params/v/c/*/*")
    w_bytes, v_bytes = w.read_bytes(), v.read_bytes()
    w.write_bytes(v_bytes)
    v.write_bytes(w_bytes)
    resumed = _train(tmp_path, 7)
    assert [step for step, _ in resumed] == ["6"] * 4 and all(checked > 0 for _, checked in resumed)
    # Process 2's own part loses its manifest (its peer keeps a sound copy): set aside, not
    # deleted, and the copy restored in its place (the second outside attack: load raised).
    [lost] = (tmp_path / "host2").glob("eqxckpt-local/*/process-2/own/6/eqxckpt.json")
    lost.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = _train(tmp_path, 7)
    assert [step for step, _ in resumed] == ["6"] * 4 and all(checked > 0 for _, checked in resumed)
    assert list(lost.parent.parent.glob(".6.set-aside-*")) and lost.exists()
    # The job resumes from the persistent step 4 and saves steps 5 and 6 again (seed 3) while
    # host 1 is away; host 1 then comes back with its tier of the first steps 5 and 6. Both
    # saves of step 6 are complete: the newer one is restored, never the one it replaced.
    away = tmp_path / "away-host1"
    shutil.move(tmp_path / "host1", away)
    _train(tmp_path, 7, LOCAL_FROM="4", LOCAL_FROM_SEED="0", LOCAL_SEED="3")
    shutil.rmtree(tmp_path / "host1")
    shutil.move(away, tmp_path / "host1")
    resumed = _train(tmp_path, 7, LOCAL_SEED="3")
    assert [step for step, _ in resumed] == ["6"] * 4 and all(checked > 0 for _, checked in resumed)
    # Restored onto another mesh (every leaf replicated): each process holds only its own
    # blocks, so every process refuses, naming the sharded leaves, before reading anything.
    logs = launch("train", 4, tmp_path, worker=WORKER, LOCAL_UNTIL="7", LOCAL_LIKE="replicated")
    refused = [line for log in logs for line in log.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 4 and all("params/w" in line and "holds only blocks" in line for line in refused)
    # The run is deleted and started afresh (seed 1): no process resumes the deleted run's step 6.
    shutil.rmtree(tmp_path / "run")
    assert _train(tmp_path, 3, LOCAL_SEED="1") == [("None", 0)] * 4
    # A new run at the same path reaches step 6 too: the local step 6 is the new run's, bit-exact.
    resumed = _train(tmp_path, 7, LOCAL_SEED="1")
    assert [step for step, _ in resumed] == ["2"] * 4 and all(checked > 0 for _, checked in resumed)
    # A host comes back with the old run's tier (run 0's parts of step 6): never mixed in.
    old = tmp_path / "old-host1"
    shutil.copytree(tmp_path / "host1", old)
    shutil.rmtree(tmp_path / "run")
    _train(tmp_path, 5, LOCAL_SEED="2")  # run 2 reaches step 4
    shutil.rmtree(tmp_path / "host1")
    shutil.copytree(old, tmp_path / "host1")
    resumed = _train(tmp_path, 6, LOCAL_SEED="2")
    assert [step for step, _ in resumed] == ["4"] * 4 and all(checked > 0 for _, checked in resumed)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 100), max_size=12), budget=st.integers(1, 150))
def test_a_part_is_offered_in_groups_within_the_budget_in_order(sizes, budget):
    from eqxckpt._local._checkpoints import _groups

    files = [(f"f{i}", np.zeros(n, np.uint8)) for i, n in enumerate(sizes)]
    groups = _groups(files, budget)
    assert [key for group in groups for key, _ in group] == [key for key, _ in files]  # each once, in order
    for group in groups:  # within the budget, or one file larger than it alone
        assert sum(data.nbytes for _, data in group) <= budget or len(group) == 1


@pytest.mark.multiprocess
def test_processes_given_different_local_settings_all_refuse_at_the_first_save(tmp_path):
    # The second outside attack: one process with local_interval_steps=2 returned while the
    # others waited out the barrier timeout and blamed a crash. Now every process refuses at
    # the first local save (step 0, which every interval saves), naming the settings.
    workers, logs = start_workers(
        WORKER, "train", 4, tmp_path, EQXCKPT_BARRIER_TIMEOUT_S="60", LOCAL_UNTIL="3", LOCAL_INTERVAL_1="2"
    )
    try:
        codes = [worker.wait(timeout=180) for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
    # Each raises it; one that was slower than process 0 (whose exit ends the coordination
    # service) may instead hear that the service is gone, or be ended by JAX's distributed
    # runtime (SIGABRT): none succeeds, none waits out the barrier timeout.
    assert codes[0] == 1 and all(code in (1, -signal.SIGABRT) for code in codes), codes
    texts = [log.read_text() for log in logs]
    assert "different local tier settings" in texts[0]
    assert all("different local tier settings" in text or "UNAVAILABLE" in text for text in texts)


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


PARTS_WORKER = WORKERS / "local_parts_worker.py"


@pytest.mark.multiprocess
def test_parts_damaged_unsendable_or_deleted_never_restore_a_wrong_or_other_step(tmp_path):
    """Two processes of two devices each, parts of one and of two blocks per leaf (the
    fifth outside attack's harness): each way a part fails is found as the restore reads
    or sends it, the part is set aside (never deleted), and a load returns the step
    `latest_step` named, bit-exact, or raises; the next `latest_step` names one that loads."""
    launch("save", 2, tmp_path, worker=PARTS_WORKER)
    [tier] = (tmp_path / "host0" / "eqxckpt-local").iterdir()

    def part(process: int, who: str, step: int) -> pathlib.Path:
        return tmp_path / f"host{process}" / "eqxckpt-local" / tier.name / f"process-{process}" / who / str(step)

    def tries(**env: str) -> list[list[str]]:
        logs = launch("resume", 2, tmp_path, worker=PARTS_WORKER, **env)
        return [[line for line in log.splitlines() if line.startswith("TRY")] for log in logs]

    # Step 5's chunks of `w` in place of step 6's in process 0's own part: each passes its CRC.
    own = part(0, "own", 6)
    for chunk in (part(0, "own", 5) / "w").rglob("c/**/*"):
        if chunk.is_file():
            shutil.copy(chunk, own / "w" / chunk.relative_to(part(0, "own", 5) / "w"))
    # Onto a finer sharding a part's blocks would be read in pieces, their digests unchecked
    # (the attack: step 5's rows returned as step 6's): refused in every process, nothing read.
    for lines in tries(LIKE="finer"):
        assert len(lines) == 1 and "RAISED StructureMismatchError" in lines[0] and "holds only blocks" in lines[0]
    # Onto the saved sharding the digest catches it: set aside, step 6 from process 1's copy.
    assert tries() == [["TRY 0 latest=6 LOADED 6 True"]] * 2
    assert len(list(own.parent.glob(".6.set-aside-*"))) == 1
    # Process 0's manifest damaged with a user's notes beside it, process 1's part replaced
    # by another checkpoint: both restored from their peers' copies, neither deleted (the
    # attack: both were overwritten by the copies).
    manifest = own / "eqxckpt.json"
    manifest.write_bytes(manifest.read_bytes().replace(b'"step"', b'"stop"', 1))
    (own / "notes.txt").write_text("mine")
    shutil.rmtree(part(1, "own", 6))
    eqxckpt.save(part(1, "own", 6), {"mine": np.arange(3)})
    assert tries() == [["TRY 0 latest=6 LOADED 6 True"]] * 2
    assert [p.read_text() for p in own.parent.glob(".6.set-aside-*/notes.txt")] == ["mine"]
    assert [eqxckpt.load(p)["mine"].tolist() for p in part(1, "own", 6).parent.glob(".6.set-aside-*")] == [[0, 1, 2]]
    # Every copy of process 0's part deleted between latest_step and load: the load raises
    # rather than restore step 5 in its place (the attack: step 5, silently); then step 5.
    gone = tries(TRIES="2", GONE_0=str(own), GONE_1=str(part(1, "peer-0", 6)))
    for lines in gone:
        assert "TRY 0 latest=6 RAISED CheckpointChangedError" in lines[0] and "latest_step() named" in lines[0]
        assert lines[1:] == ["TRY 1 latest=5 LOADED 5 True"]
    # Process 0's part of step 5 lost and the copy process 1 keeps unreadable (a link in
    # it): the copy is set aside, the load raises, and the persistent step 4 loads next
    # (the attack: every restart raised the same error, forever).
    shutil.rmtree(part(0, "own", 5))
    os.symlink("/etc/hostname", part(1, "peer-0", 5) / "notes")
    for lines in tries(TRIES="2"):
        assert "TRY 0 latest=5 RAISED CorruptCheckpointError" in lines[0] and "no sound copy" in lines[0]
        assert lines[1:] == ["TRY 1 latest=4 LOADED 4 True"]
    assert list(part(1, "peer-0", 5).parent.glob(".5.set-aside-*/notes"))


@pytest.mark.multiprocess
def test_a_copy_sent_is_restored_as_it_arrives_then_kept_only_if_sound(tmp_path):
    """A process whose part was lost restores from the copy its peer sends as it arrives
    (never first written to its disk), then keeps it: byte for byte the copy. A copy whose
    bytes fail the digest as they are read is never kept; its keeper sets it aside."""
    launch("save", 2, tmp_path, worker=PARTS_WORKER)
    [tier] = (tmp_path / "host0" / "eqxckpt-local").iterdir()
    own = tmp_path / "host0" / "eqxckpt-local" / tier.name / "process-0" / "own"
    copy = tmp_path / "host1" / "eqxckpt-local" / tier.name / "process-1" / "peer-0"

    def files(part: pathlib.Path) -> dict[str, bytes]:
        return {str(f.relative_to(part)): f.read_bytes() for f in part.rglob("*") if f.is_file()}

    def tries(**env: str) -> list[list[str]]:
        logs = launch("resume", 2, tmp_path, worker=PARTS_WORKER, **env)
        return [[line for line in log.splitlines() if line.startswith("TRY")] for log in logs]

    shutil.rmtree(own / "6")
    assert tries() == [["TRY 0 latest=6 LOADED 6 True"]] * 2
    assert files(own / "6") == files(copy / "6")  # kept again, as sent
    # A byte of `u` flipped in the copy, and a restore of `w` alone (the seventh outside
    # attack: the copy was kept, damaged, and the next restore failed on it): `w` comes back
    # bit-exact, and the copy, checked whole before it is kept, is not kept.
    shutil.rmtree(own / "6")
    chunk = next(f for f in (copy / "6" / "u").rglob("c/**/*") if f.is_file())
    saved = chunk.read_bytes()
    chunk.write_bytes(bytes([saved[0] ^ 1]) + saved[1:])
    assert tries(AT="w") == [["TRY 0 latest=6 LOADED w of 6 True"]] * 2
    assert not (own / "6").exists()
    chunk.write_bytes(saved)
    # Step 5's chunks of `w` in the copy (each passes its CRC), process 0's own part lost.
    for chunk in (copy / "5" / "w").rglob("c/**/*"):
        if chunk.is_file():
            shutil.copy(chunk, copy / "6" / "w" / chunk.relative_to(copy / "5" / "w"))
    for lines in tries(TRIES="2"):
        assert "TRY 0 latest=6 RAISED CorruptCheckpointError" in lines[0] and "no sound copy" in lines[0]
        assert lines[1:] == ["TRY 1 latest=5 LOADED 5 True"]
    assert not (own / "6").exists() and len(list(copy.glob(".6.set-aside-*"))) == 1
    assert not list(own.glob(".6.*"))  # nothing of the damaged copy was ever written here


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
