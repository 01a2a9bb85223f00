"""A run's steps (eqxckpt/_steps.py): which entries of its directory are committed steps,
and `RunSteps`, the steps a manager knows, with retention and reader-safe deletion."""

import os

import numpy as np
import pytest

import eqxckpt
from eqxckpt._retention import Retention
from eqxckpt._steps import MANAGER_KEY, RunSteps, is_step_name, manager_record, scan_steps, step_metrics
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
