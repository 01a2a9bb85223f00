"""Each process's own state saved with a checkpoint (`_process_state`): encodings, the
manifest field's validation, the manager's tiers, and a real multi-process Grain job
killed and resumed."""

import dataclasses
import json
import random
import re
import signal

import grain
import numpy as np
import pytest
from _trees import crafted_manifest
from conftest import WORKERS, launch, start_workers
from hypothesis import given, settings, strategies as st

import eqxckpt
from eqxckpt._errors import ArgumentError, CheckpointError, ManifestError
from eqxckpt._manifest import parse_manifest
from eqxckpt._process_state import MAX_STATE_BYTES, ProcessStates, SavedState

WORKER = WORKERS / "data_pipeline_worker.py"

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(value=JSON.filter(lambda v: v is not None) | st.binary(max_size=64))  # None: no state
def test_every_json_value_and_bytes_come_back_as_given(tmp_path_factory, value):
    path = tmp_path_factory.mktemp("state") / "c"
    eqxckpt.save(path, {"w": np.ones(2)}, process_state=value)
    back = eqxckpt.open(path).process_state()
    assert back == value and type(back) is type(value if not isinstance(value, bytearray) else b"")


def test_what_json_would_change_or_cannot_hold_is_refused_at_save(tmp_path):
    for value, match in [
        ((1, 2), "tuples become lists"),
        ({1: "a"}, "only string keys"),
        ({"x": float("nan")}, "must be JSON"),
        (object(), r"\(object\), which JSON would not give back"),
        ("x" * MAX_STATE_BYTES, "over the"),
    ]:
        with pytest.raises(ArgumentError, match=match):
            eqxckpt.save(tmp_path / "c", {"w": np.ones(2)}, process_state=value)
        assert not (tmp_path / "c").exists()


def test_a_checkpoint_without_states_or_another_job_size_says_what_to_do(tmp_path):
    eqxckpt.save(tmp_path / "none", {"w": np.ones(2)})
    with pytest.raises(CheckpointError, match="saved without a process_state"):
        eqxckpt.open(tmp_path / "none").process_state()
    states = ProcessStates(2, {0: SavedState.of({"at": 0}), 1: SavedState.of(b"one")})
    with pytest.raises(CheckpointError, match="saved by 2 processes.*this job has 1.*from_process"):
        states.value(None, 0, 1, "ckpt")
    assert states.value(1, 0, 1, "ckpt") == b"one" and states.value(0, 0, 1, "ckpt") == {"at": 0}
    with pytest.raises(ArgumentError, match="from_process must be an int in"):
        states.value(2, 0, 1, "ckpt")
    with pytest.raises(CheckpointError, match="Process 1 saved no process_state"):
        ProcessStates(2, {0: SavedState.of(1)}).value(1, 1, 2, "ckpt")


def _with_states(tmp_path, states) -> bytes:
    eqxckpt.save(tmp_path / "c", {"w": np.ones(2)}, process_state=1, overwrite=True)
    raw = (tmp_path / "c" / "eqxckpt.json").read_bytes()
    doc = json.loads(raw)
    doc["process_states"] = states
    return crafted_manifest(doc)


@pytest.mark.parametrize(
    "states, why",
    [
        ([], "not {processes, states}"),
        ({"processes": 0, "states": {}}, "name 0 processes"),
        ({"processes": True, "states": {}}, "name True processes"),
        ({"processes": 2, "states": []}, "no object of states"),
        ({"processes": 2, "states": {"2": {"json": 1}}}, "process '2' of 2"),
        ({"processes": 2, "states": {"01": {"json": 1}}}, "process '01' of 2"),
        ({"processes": 2, "states": {"-1": {"json": 1}}}, "process '-1' of 2"),
        ({"processes": 2, "states": {"0": {"json": 1, "bytes": ""}}}, "not {json} or {bytes}"),
        ({"processes": 2, "states": {"0": {"pickle": "x"}}}, "not {json} or {bytes}"),
        ({"processes": 2, "states": {"0": {"bytes": "not base64!"}}}, "not base64"),
        ({"processes": 2, "states": {"0": {"bytes": 3}}}, "not base64"),
    ],
)
def test_a_malformed_process_states_field_is_refused(tmp_path, states, why):
    raw = _with_states(tmp_path, states)
    with pytest.raises(ManifestError, match="process_states that.*" + re.escape(why)):
        parse_manifest(raw, "c")


def _loader():
    return iter(grain.MapDataset.range(500).shuffle(seed=5).batch(4).to_iter_dataset())


@pytest.mark.parametrize("local", [False, True])
def test_the_manager_gives_a_grain_iterator_its_position_from_the_step_restored(tmp_path, local):
    options = {"local_path": tmp_path / "local", "local_interval_steps": 2} if local else {}
    iterator = _loader()
    with eqxckpt.CheckpointManager(tmp_path / "run", save_interval_steps=5, blocking=True, **options) as manager:
        for step in range(13):
            next(iterator)
            manager.save(step, {"step": np.int32(step)}, process_state=iterator)
    with eqxckpt.CheckpointManager(tmp_path / "run", save_interval_steps=5, **options) as manager:
        resumed = manager.latest_step()
        assert resumed == (12 if local else 10)
        restored = _loader()
        state = manager.load({"step": np.int32(0)}, process_state=restored)
        assert int(state["step"]) == resumed
        reference = _loader()
        for _ in range(resumed + 1):
            next(reference)
        for _ in range(3):
            np.testing.assert_array_equal(next(restored), next(reference))
        with pytest.raises(ArgumentError, match="with set_state"):
            manager.load({"step": np.int32(0)}, step=10, process_state={"not": "an iterator"})
        with pytest.raises(ArgumentError, match="pass process_state too"):
            manager.load({"step": np.int32(0)}, step=10, from_process=0)
        fresh = _loader()  # a persistent step by number, whatever the local tier holds
        manager.load({"step": np.int32(0)}, step=5, process_state=fresh)
        assert eqxckpt.open(manager.path(5)).process_state() == fresh.get_state()


def _batches(log: str) -> tuple[str, dict[int, list], list]:
    lines = log.splitlines()
    [resumed] = [line.split(" ", 1)[1] for line in lines if line.startswith("RESUMED")]
    batches = {int(line.split()[1]): json.loads(line.split(" ", 2)[2]) for line in lines if line.startswith("BATCH")}
    after = [json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith("NEXT")]
    return resumed, batches, after[0] if after else None


def _pipeline():
    """The worker's `pipeline`, imported from its script."""
    import sys

    sys.path.insert(0, str(WORKERS))
    from data_pipeline_worker import pipeline

    return pipeline


def _expected(process: int, processes: int, steps: int) -> list[list[int]]:
    iterator = iter(_pipeline()(process, processes))
    return [next(iterator).tolist() for _ in range(steps)]


@pytest.mark.multiprocess
def test_a_killed_grain_job_resumes_with_exactly_the_batches_it_would_have_seen(tmp_path):
    """Two processes, each its own shard of a Grain pipeline, kill themselves at a random
    step; resumed (from the local tier, then the persistent one alone), each reads on
    exactly as an uninterrupted run would have."""
    until = 14
    crash_at = random.Random().randrange(4, until - 2)
    expected = [_expected(p, 2, until + 1) for p in range(2)]
    workers, logs = start_workers(
        WORKER, "train", 2, tmp_path, EQXCKPT_BARRIER_TIMEOUT_S="60", DATA_UNTIL=str(until), DATA_CRASH_AT=str(crash_at)
    )
    for worker in workers:
        assert worker.wait(timeout=240) == -signal.SIGKILL, [log.read_text() for log in logs]
    for p, log in enumerate(logs):
        _, batches, _ = _batches(log.read_text())
        assert batches == {s: expected[p][s] for s in range(crash_at)}, crash_at
    resumed_from = []
    for local in ("1", "0"):  # with the local tier; then from the persistent steps alone
        logs = launch("train", 2, tmp_path, worker=WORKER, DATA_UNTIL=str(until), DATA_LOCAL=local)
        for p, log in enumerate(logs):
            resumed, batches, after = _batches(log)
            step, state_step = resumed.split()
            assert step == state_step != "None", resumed  # the tree and the iterator of one step
            assert batches == {s: expected[p][s] for s in range(int(step) + 1, until)}, (crash_at, resumed)
            assert after == expected[p][until], (crash_at, resumed)
            resumed_from.append(int(step))
    local_step, _, persistent_step, _ = resumed_from
    assert crash_at - 3 <= local_step < crash_at, (crash_at, resumed_from)
    assert persistent_step == until - 1 - (until - 1) % 3, resumed_from  # the run's last persistent step
    saved = eqxckpt.open(tmp_path / "run" / str(persistent_step))
    with pytest.raises(CheckpointError, match="saved by 2 processes.*this job has 1"):
        saved.process_state()
    iterator = iter(_pipeline()(1, 2))  # process 1's state, asked for by its index
    iterator.set_state(saved.process_state(1))
    assert next(iterator).tolist() == expected[1][persistent_step + 1]


class _LiveIterator:
    """An iterator whose get_state() returns its live dict, as many do."""

    def __init__(self):
        self.state = {"position": 0}

    def get_state(self):
        return self.state

    def set_state(self, state):
        self.state = state

    def __next__(self):
        self.state["position"] += 1


def test_a_background_save_commits_the_state_as_it_was_when_save_was_called(tmp_path):
    state = {"position": 0, "seen": [1]}
    handle = eqxckpt.save(tmp_path / "c", {"w": np.ones(1 << 20)}, blocking=False, process_state=state)
    state["position"], _ = 999, state["seen"].append(2)
    handle.wait()
    assert eqxckpt.open(tmp_path / "c").process_state() == {"position": 0, "seen": [1]}
    live = _LiveIterator()
    with eqxckpt.CheckpointManager(tmp_path / "run") as manager:  # in the background
        manager.save(1, {"w": np.ones(1 << 20)}, process_state=live)
        for _ in range(7):
            next(live)
        manager.wait()
        restored = _LiveIterator()
        manager.load({"w": np.zeros(1 << 20)}, process_state=restored)
    assert restored.state == {"position": 0}


def _nested(depth, inner=0):
    for _ in range(depth):
        inner = [inner]
    return inner


def test_deep_enum_and_oversized_states_are_refused_before_anything_is_written(tmp_path):
    import enum

    class Kind(enum.IntEnum):
        A = 1

    for value, match in [
        (_nested(950), "nested more than 100"),
        ({"k": Kind.A}, r"\(Kind\), which JSON would not give back"),
        ([0] * 2000, "very many tiny JSON values"),
        (np.int64(3), "int64"),
        ([[0] * 10_000] * 8, "over the 65536"),
    ]:
        with pytest.raises(ArgumentError, match=match):
            eqxckpt.save(tmp_path / "c", {"w": np.ones(2)}, process_state=value)
        assert not (tmp_path / "c").exists()
    assert SavedState.of(_nested(30)).value() == _nested(30)


def test_the_states_of_every_process_within_their_share_keep_the_manifest_loadable(tmp_path):
    """Each process's share shrinks with the job's size, and states are written compactly:
    the most every process may save is a manifest a load reads."""
    from eqxckpt._manifest import MAX_MANIFEST_BYTES
    from eqxckpt._process_state import MAX_STATES_BYTES, state_limit

    eqxckpt.save(tmp_path / "c", {"w": np.ones(2)})
    manifest = eqxckpt.open(tmp_path / "c").stored.manifest
    for processes in (4, 1024):
        limit = state_limit(processes)
        assert limit * processes <= MAX_STATES_BYTES < MAX_MANIFEST_BYTES // 2
        inner = [123456789] * ((limit - 2 * 95 - 20) // 10)  # deep and wide, just within the share
        state = SavedState.of(_nested(95, inner), processes)
        with pytest.raises(ArgumentError, match=f"of a job of {processes}"):
            SavedState.of(_nested(95, inner + [123456789] * 5), processes)
        full = dataclasses.replace(
            manifest, process_states=ProcessStates(processes, dict.fromkeys(range(processes), state))
        )
        raw = full.to_bytes()
        assert len(raw) < MAX_STATES_BYTES + 4096
        assert parse_manifest(raw, "c").process_states == full.process_states
