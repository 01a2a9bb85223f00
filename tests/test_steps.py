"""A run's steps (eqxckpt/_steps.py): which entries of its directory are committed steps,
and `RunSteps`, the steps a manager knows, with retention and reader-safe deletion."""

import concurrent.futures
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest
from conftest import run_cli

import eqxckpt
from eqxckpt._paths import RUN_NAME
from eqxckpt._run._retention import Retention
from eqxckpt._run._steps import (
    MANAGER_KEY,
    RunSteps,
    clean_leftovers,
    is_step_name,
    manager_record,
    read_run_id,
    run_identity_bytes,
    scan_steps,
    step_metrics,
)
from eqxckpt._storage import resolve


def save_step(run, step: int, **metrics: float) -> None:
    metadata = {MANAGER_KEY: manager_record(step, metrics)}
    eqxckpt.save(run / str(step), {"w": np.full(3, float(step), np.float32)}, metadata=metadata)


@pytest.mark.parametrize("name,is_step", [("0", True), ("7", True), ("120", True), ("007", False), ("-1", False)])
def test_step_names(name, is_step):
    assert is_step_name(name) is is_step
    assert not is_step_name("7 ") and not is_step_name("") and not is_step_name("1e3")


def test_scan_lists_committed_steps_and_names_the_rest(tmp_path):
    run = tmp_path / "run"
    for step in (1, 3, 4):
        save_step(run, step, loss=step / 10)
    save_step(run, 5, loss=float("nan"))
    (run / "007").mkdir()  # a copy's name
    (run / "6").mkdir()  # an entry named like a step, with no checkpoint in it
    (run / "notes.txt").write_text("mine")
    manifest = run / "4" / "eqxckpt.json"
    manifest.write_bytes(manifest.read_bytes()[:-20])  # damaged
    location = resolve(run)
    scan = scan_steps(location)
    assert sorted(scan.committed) == [1, 3, 5]
    assert scan.committed[3] == {"loss": 0.3} and np.isnan(scan.committed[5]["loss"])
    assert list(scan.unreadable) == [4] and scan.unreadable[4].startswith("ManifestError")
    assert sorted(scan.skipped) == sorted(
        ["007 (not a step number)", "6 (no committed checkpoint in it)", "notes.txt (not a step number)"]
        + [f"4 ({scan.unreadable[4]})"]
    )
    warning = scan.warning(location)
    assert warning is not None and "skipped 4 entries" in warning and "7, not 007" in warning
    assert step_metrics(location.sub("1")) == {"loss": 0.1}


def test_scan_of_an_empty_run(tmp_path):
    scan = scan_steps(resolve(tmp_path))
    assert scan.committed == {} and scan.unreadable == {} and scan.warning(resolve(tmp_path)) is None


def test_a_step_without_the_managers_record_has_no_metrics(tmp_path):
    eqxckpt.save(tmp_path / "2", {"w": np.zeros(2)}, metadata={"lr": 0.1})
    assert scan_steps(resolve(tmp_path)).committed == {2: {}}


def run_steps(run, retention: Retention) -> RunSteps:
    location = resolve(run)
    return RunSteps(location, retention, scan_steps(location))


def test_retention_deletes_what_it_drops_but_not_under_a_reader(tmp_path):
    for step in range(3):
        save_step(tmp_path, step)
    steps = run_steps(tmp_path, Retention(max_to_keep=2))
    assert steps.committed() == [0, 1, 2]
    with steps.reading(None) as latest, steps.reading(0) as oldest:
        assert (latest, oldest) == (2, 0)
        save_step(tmp_path, 3)
        steps.add(3, {})
        assert steps.committed() == [2, 3]
        assert sorted(os.listdir(tmp_path)) == ["0", "2", "3"]  # 1 deleted; 0 is being read
    assert sorted(os.listdir(tmp_path)) == ["2", "3"]  # deleted once its reader is done
    with pytest.raises(eqxckpt.CheckpointNotFoundError, match="No committed step 0 .* steps: \\[2, 3\\]"):
        steps.resolve(0)


def test_resolve_skips_steps_found_gone(tmp_path):
    for step in range(3):
        save_step(tmp_path, step, loss=1.0 - step)
    steps = run_steps(tmp_path, Retention(best_metric="loss"))
    assert steps.resolve(None) == 2 and steps.resolve(None, gone={2}) == 1
    assert steps.committed() == [0, 1]  # forgotten until listed again
    assert steps.best() == 1 and steps.metrics(1) == {"loss": 0.0}
    steps.rescan()
    assert steps.committed() == [0, 1, 2] and steps.best() == 2
    with pytest.raises(eqxckpt.CheckpointNotFoundError, match="No committed checkpoint"):
        run_steps(tmp_path / "empty", Retention()).resolve(None)


def test_a_saved_or_unreadable_step_is_never_saved_again(tmp_path):
    for step in range(2):
        save_step(tmp_path, step)
    manifest = tmp_path / "1" / "eqxckpt.json"
    manifest.write_bytes(manifest.read_bytes()[:-20])
    steps = run_steps(tmp_path, Retention())
    steps.check_new(2)
    with pytest.raises(eqxckpt.CheckpointExistsError, match="Step 0 is already saved"):
        steps.check_new(0)
    with pytest.raises(eqxckpt.CheckpointExistsError, match="Step 1 of .* cannot be read"):
        steps.check_new(1)
    assert steps.step_path(2) == resolve(tmp_path).sub("2").user_path()


def test_a_directory_named_a_step_with_a_trailing_newline_is_not_a_step(tmp_path):
    # _STEP_NAME's `$` matches before a final "\n": scan_steps reads "12\n" (which exists) and lists
    # step 12, whose path ("12") does not exist. b0b80a8 read int(name)'s path and left it out.
    import shutil
    import warnings

    with eqxckpt.CheckpointManager(tmp_path / "run", blocking=True) as manager:
        manager.save(3, {"w": np.full(2, 3.0)})
    shutil.copytree(tmp_path / "run" / "3", tmp_path / "run" / "12\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager = eqxckpt.CheckpointManager(tmp_path / "run")
    assert manager.all_steps() == [3]
    assert manager.latest_step() == 3
    manager.close()


# -- the run's identity -------------------------------------------------------------


def test_the_run_identity_is_created_once_and_read_back(tmp_path):
    location = resolve(tmp_path / "run")
    assert read_run_id(location, create=False) is None
    assert not (tmp_path / "run").exists()  # reading creates nothing
    run_id = read_run_id(location, create=True)
    assert run_id is not None and re.fullmatch(r"[0-9a-f]{32}", run_id)
    stored = (tmp_path / "run" / RUN_NAME).read_bytes()
    assert stored == run_identity_bytes(run_id) and json.loads(stored) == {"run": run_id, "format": 1}
    assert read_run_id(location, create=True) == read_run_id(location, create=False) == run_id
    assert location.create_once(RUN_NAME, run_identity_bytes("0" * 32)) is False  # never rewritten
    assert (tmp_path / "run" / RUN_NAME).read_bytes() == stored
    assert [p.name for p in (tmp_path / "run").iterdir()] == [RUN_NAME]  # no temporary left beside it


def test_run_steps_reads_the_identity_once_and_again_after_a_rescan(tmp_path):
    save_step(tmp_path, 1)
    steps = run_steps(tmp_path, Retention())
    assert steps.run_id(create=False) is None
    first = steps.run_id(create=True)
    assert first is not None and steps.run_id(create=False) == first
    other = "ab" * 16
    (tmp_path / RUN_NAME).write_bytes(run_identity_bytes(other))  # replaced behind the manager's back
    assert steps.run_id(create=True) == first  # kept: no read per call
    steps.rescan()
    assert steps.run_id(create=False) == other and steps.committed() == [1]


def _race(run, creators: int) -> list:
    barrier = threading.Barrier(creators)

    def create(_):
        barrier.wait()
        return read_run_id(resolve(run), create=True)

    with concurrent.futures.ThreadPoolExecutor(creators) as pool:
        return list(pool.map(create, range(creators)))


def test_threads_racing_to_create_the_identity_all_get_one(tmp_path):
    for attempt in range(10):
        run = tmp_path / f"run{attempt}"
        found = _race(run, 8)
        assert len(set(found)) == 1 and found[0] is not None
        assert json.loads((run / RUN_NAME).read_bytes())["run"] == found[0]
        assert sorted(os.listdir(run)) == [RUN_NAME]


RACER = """
import os, sys, time
from eqxckpt._run._steps import read_run_id
from eqxckpt._storage import resolve
go, runs = sys.argv[1], sys.argv[2:]
while not os.path.exists(go):
    time.sleep(0.001)
print(" ".join(read_run_id(resolve(run), create=True) for run in runs), flush=True)
"""


def test_two_processes_racing_to_create_the_identity_get_one(tmp_path):
    runs = [str(tmp_path / f"run{i}") for i in range(20)]
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pathlib.Path(__file__).parent.parent), *sys.path])}
    racers = [
        subprocess.Popen([sys.executable, "-c", RACER, str(go), *runs], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    time.sleep(3)  # both past their imports
    go.touch()
    outputs = [racer.communicate(timeout=120)[0].split() for racer in racers]
    assert all(racer.returncode == 0 for racer in racers)
    assert outputs[0] == outputs[1] and len(set(outputs[0])) == len(runs)  # one id per run, a new one each
    assert outputs[0] == [json.loads((pathlib.Path(run) / RUN_NAME).read_bytes())["run"] for run in runs]


def test_a_run_deleted_and_begun_again_has_a_new_identity(tmp_path):
    run = tmp_path / "run"
    save_step(run, 1)
    steps = run_steps(run, Retention())
    first = steps.run_id(create=True)
    shutil.rmtree(run)
    save_step(run, 1)
    steps.rescan()
    second = steps.run_id(create=True)
    assert first is not None and second is not None and second != first
    assert read_run_id(resolve(run), create=False) == second


VALID = run_identity_bytes("0123456789abcdef" * 2)


@pytest.mark.parametrize(
    "raw,found",
    [
        (b"[1, 2]", "is not a JSON object"),
        (b"{}", "holds the fields []"),
        (b"not json", "is not valid JSON"),
        (b"\xff\xfe{}", "is not valid JSON"),
        (b'{"run": "%s", "run": "%s", "format": 1}' % (b"a" * 32, b"b" * 32), "names 'run' twice"),
        (VALID[:-2] + b', "extra": 1}', "holds the fields ['extra', 'format', 'run']"),
        (b'{"run": "%s", "format": 1}' % (b"A" * 32), 'names the run "AAAA'),
        (b'{"run": "%s", "format": 1}' % (b"a" * 31), "names the run"),
        (b'{"run": 12, "format": 1}', "names the run 12"),
        (b'{"run": "%s", "format": "1"}' % (b"a" * 32), 'names format "1"'),
        (b'{"run": "%s", "format": true}' % (b"a" * 32), "names format true"),
        (b'{"run": "%s", "format": 2}' % (b"a" * 32), "names format 2, which this eqxckpt does not know"),
        (VALID + b" " * 5000, "holds more than 4096 bytes"),
    ],
)
def test_a_run_identity_that_is_not_exactly_eqxckpts_is_refused(tmp_path, raw, found):
    tmp_path.joinpath(RUN_NAME).write_bytes(raw)
    steps = run_steps(tmp_path, Retention())
    for call in (lambda: steps.run_id(create=False), lambda: read_run_id(resolve(tmp_path), create=True)):
        with pytest.raises(eqxckpt.ManifestError) as raised:
            call()
        message = str(raised.value)
        assert message.startswith(f"{tmp_path / RUN_NAME} {found}")
        assert '"run": "<32 lowercase hex digits>", "format": 1} in at most 4096 bytes' in message
        assert "Restore it from a copy of the run" in message
    assert tmp_path.joinpath(RUN_NAME).read_bytes() == raw  # never rewritten


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_a_run_identity_that_is_no_regular_file_is_refused(tmp_path, kind):
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_bytes(VALID)
    run = tmp_path / "run"
    run.mkdir()
    if kind == "symlink":
        (run / RUN_NAME).symlink_to(elsewhere)
    else:
        (run / RUN_NAME).mkdir()
    with pytest.raises(eqxckpt.ManifestError, match=f"{re.escape(str(run / RUN_NAME))} cannot be read .*refused"):
        read_run_id(resolve(run), create=True)
    assert (run / RUN_NAME).is_symlink() == (kind == "symlink") and elsewhere.read_bytes() == VALID


def test_scan_clean_retention_and_verify_leave_the_identity_alone(tmp_path):
    run = tmp_path / "run"
    location = resolve(run)
    run_id = read_run_id(location, create=True)
    with pytest.raises(eqxckpt.CheckpointNotFoundError, match="a CheckpointManager run with no committed step yet"):
        eqxckpt.load(run, {"w": np.zeros(3, np.float32)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither the scan nor the cleanup says a word about it
        with eqxckpt.CheckpointManager(run, max_to_keep=1, blocking=True) as manager:
            for step in range(3):
                manager.save(step, {"w": np.full(3, float(step), np.float32)})
    assert sorted(os.listdir(run)) == ["2", RUN_NAME]  # retention deleted steps 0 and 1 only
    scan = scan_steps(location)
    assert list(scan.committed) == [2] and scan.skipped == [] and scan.warning(location) is None
    assert clean_leftovers(location) is None
    assert location.entries() == [("2", "committed")]
    assert location.list_entries() == [("2", "committed"), (RUN_NAME, "other")]
    assert read_run_id(location, create=False) == run_id
    status, out, err = run_cli("verify", str(run))
    assert status == 0 and "1 checkpoint, all intact" in out and RUN_NAME not in out + err
    status, out, err = run_cli("inspect", str(run))
    assert status != 0 and "directory of 1 checkpoint (a CheckpointManager run): 2" in out + err


def test_of_threads_racing_to_create_the_file_exactly_one_writes(tmp_path):
    for attempt in range(10):
        run = resolve(tmp_path / f"run{attempt}")
        raws = [run_identity_bytes(f"{i:032x}") for i in range(8)]
        barrier = threading.Barrier(len(raws))

        def create(raw, run=run, barrier=barrier):
            barrier.wait()
            return run.create_once(RUN_NAME, raw)

        with concurrent.futures.ThreadPoolExecutor(len(raws)) as pool:
            created = list(pool.map(create, raws))
        assert created.count(True) == 1
        assert (tmp_path / f"run{attempt}" / RUN_NAME).read_bytes() == raws[created.index(True)]
        assert os.listdir(tmp_path / f"run{attempt}") == [RUN_NAME]


def test_retention_leaves_files_eqxckpt_did_not_write_with_a_warning(tmp_path):
    """#53 defect 7: a user's file inside a committed step directory on a local disk was
    deleted with the step. eqxckpt deletes what the manifest says it wrote, and leaves
    the rest where it was, naming it."""
    run = tmp_path / "run"
    with eqxckpt.CheckpointManager(run, max_to_keep=1) as manager:
        manager.save(0, {"w": np.arange(6.0), "step": 0})
        manager.wait()
        (run / "0" / "notes.txt").write_text("mine")
        (run / "0" / "w" / "plot.png").write_bytes(b"png")
        with pytest.warns(UserWarning, match=r"Retention deleted step 0 .* kept 2 files .*notes.txt, w/plot.png"):
            manager.save(1, {"w": np.arange(6.0) + 1, "step": 1})
            manager.wait()
        assert manager.all_steps() == [1]
    [kept] = run.glob("0.kept-*")  # beside it: step 0 may be saved again
    left = sorted(str(p.relative_to(kept)) for p in kept.rglob("*"))
    assert left == ["notes.txt", "w", "w/plot.png"] and (kept / "notes.txt").read_text() == "mine"
    assert not (run / "0").exists()
    # Another step without such files goes whole, without a word.
    with eqxckpt.CheckpointManager(run, max_to_keep=1) as manager, warnings.catch_warnings():
        warnings.filterwarnings("error", message="Retention")
        manager.save(2, {"w": np.arange(6.0) + 2, "step": 2})
        manager.wait()
        assert manager.all_steps() == [2] and not (run / "1").exists()


def test_retention_keeps_a_damaged_leaf_whole_with_the_users_files(tmp_path):
    """The eighth outside attack: with one leaf's zarr.json damaged, which files eqxckpt
    wrote could not be told, and retention deleted the step whole, the user's notes too.
    A leaf whose layout cannot be read is kept whole, as are the notes."""
    run = tmp_path / "run"
    with eqxckpt.CheckpointManager(run, max_to_keep=1) as manager:
        manager.save(0, {"w": np.arange(6.0), "b": np.arange(4.0)})
        manager.wait()
        (run / "0" / "notes.txt").write_text("mine")
        (run / "0" / "b" / "zarr.json").write_text("garbage")
        with pytest.warns(UserWarning, match=r"kept 2 files .*: notes.txt, b\."):
            manager.save(1, {"w": np.arange(6.0) + 1, "b": np.arange(4.0)})
            manager.wait()
        assert manager.all_steps() == [1] and not (run / "0").exists()
    [kept] = run.glob("0.kept-*")
    assert (kept / "notes.txt").read_text() == "mine" and (kept / "b" / "zarr.json").read_text() == "garbage"
    eqxckpt.save(run / "0", {"w": np.arange(6.0)})  # its name is free again
