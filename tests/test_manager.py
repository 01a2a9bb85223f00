import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
from conftest import WORKERS, assert_trees_equal, crafted_manifest, kill_when, manifest_doc
from hypothesis import HealthCheck, given, settings, strategies as st

import eqxckpt


def tree(step: int) -> dict:
    return {"w": np.full((4, 3), float(step), np.float32), "step": step}


def test_retention_newest_every_and_best(tmp_path):
    losses = {s: abs(s - 7) + 0.5 for s in range(20)}  # best (lowest) at step 7
    with eqxckpt.CheckpointManager(tmp_path, max_to_keep=2, keep_every=5, best_metric="loss", keep_best=1) as manager:
        for step in range(20):
            assert manager.save(step, tree(step), metrics={"loss": losses[step]})
    expected = [0, 5, 7, 10, 15, 18, 19]
    assert manager.all_steps() == expected
    assert sorted(int(p) for p in os.listdir(tmp_path)) == expected  # deleted for real, nothing left over
    assert manager.latest_step() == 19 and manager.best_step() == 7
    np.testing.assert_array_equal(manager.load()["w"], np.full((4, 3), 19.0))
    np.testing.assert_array_equal(manager.load(tree(0), step=7)["w"], np.full((4, 3), 7.0))
    # A new manager on the same directory sees the same steps and metrics.
    again = eqxckpt.CheckpointManager(tmp_path, max_to_keep=2, keep_every=5, best_metric="loss", keep_best=1)
    assert again.all_steps() == expected and again.best_step() == 7 and again.metrics(7) == {"loss": 0.5}


@pytest.mark.parametrize("mode,best", [("min", 3), ("max", 6)])
def test_best_metric_in_both_modes(tmp_path, mode, best):
    accuracy = {0: 0.5, 1: 0.2, 2: 0.7, 3: 0.1, 4: 0.6, 5: 0.3, 6: 0.9, 7: float("nan")}
    manager = eqxckpt.CheckpointManager(tmp_path, max_to_keep=1, best_metric="acc", best_mode=mode, keep_best=2)
    for step, value in accuracy.items():
        manager.save(step, tree(step), metrics={"acc": value})
    manager.wait()
    second = {"min": 1, "max": 2}[mode]
    assert manager.best_step() == best
    assert manager.all_steps() == sorted({best, second, 7})  # NaN never ranks best; 7 is the newest


def test_interval_force_and_metadata(tmp_path):
    manager = eqxckpt.CheckpointManager(tmp_path, save_interval_steps=3, blocking=True)
    saved = [step for step in range(10) if manager.save(step, tree(step), metadata={"lr": 0.1 * step})]
    assert saved == [0, 3, 6, 9]
    assert manager.save(4, tree(4), force=True)
    assert manager.all_steps() == [0, 3, 4, 6, 9]
    assert manager.metadata(6) == {"lr": pytest.approx(0.6)} and manager.metadata()["lr"] == pytest.approx(0.9)
    with pytest.raises(eqxckpt.CheckpointExistsError, match="Step 6 is already saved"):
        manager.save(6, tree(6))
    with pytest.raises(eqxckpt.CheckpointNotFoundError, match="No committed step 5"):
        manager.load(step=5)
    with pytest.raises(eqxckpt.CheckpointError, match="reserved"):
        manager.save(12, tree(12), metadata={"eqxckpt.manager": 1})
    with pytest.raises(ValueError, match="keep_best needs best_metric"):
        eqxckpt.CheckpointManager(tmp_path, keep_best=1)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_to_keep": 0}, "max_to_keep must be a positive int or None, got 0"),
        ({"max_to_keep": "2"}, "max_to_keep must be an int or None, got str '2'"),
        ({"keep_every": -5}, "keep_every must be a positive int"),
        ({"keep_best": 0, "best_metric": "loss"}, "keep_best must be a positive int"),
        ({"keep_best": 1}, "keep_best needs best_metric"),
        ({"best_mode": "lowest", "best_metric": "loss"}, "best_mode must be 'min' or 'max', got 'lowest'"),
        ({"save_interval_steps": 0}, "save_interval_steps must be a positive int"),
        ({"save_interval_steps": 2.5}, "save_interval_steps must be an int, got float 2.5"),
        ({"preemption_grace_s": 0}, "preemption_grace_s must be a positive number of seconds"),
        ({"preemption_grace_s": float("inf")}, "preemption_grace_s must be a positive number"),
        ({"preemption_grace_s": True}, "preemption_grace_s must be a number, got bool True"),
        ({"preemption_grace_s": "30"}, "preemption_grace_s must be a number, got str '30'"),
    ],
)
def test_each_bad_argument_is_an_argument_error(tmp_path, kwargs, match):
    with pytest.raises(eqxckpt.ArgumentError, match=match) as caught:
        eqxckpt.CheckpointManager(tmp_path, **kwargs)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, eqxckpt.CheckpointError)
    assert not os.listdir(tmp_path)  # refused before touching the directory


@pytest.mark.parametrize("step", [-1, True, 1.0, "3"])
def test_a_bad_step_is_an_argument_error(tmp_path, step):
    with eqxckpt.CheckpointManager(tmp_path, blocking=True) as manager:
        with pytest.raises(eqxckpt.ArgumentError, match="step must be (a non-negative int|an int)") as caught:
            manager.save(step, tree(0))
        assert isinstance(caught.value, ValueError)
        assert manager.all_steps() == []


def test_background_failure_is_raised_by_the_next_save(tmp_path):
    run = tmp_path / "run"
    manager = eqxckpt.CheckpointManager(run)
    manager.save(0, tree(0))
    manager.wait()
    run.rename(tmp_path / "moved")
    run.write_text("a file where the run directory was")  # only the background write finds out
    manager.save(1, tree(1))
    with pytest.raises(eqxckpt.CheckpointWriteError):
        manager.save(2, tree(2))
    run.unlink()
    (tmp_path / "moved").rename(run)
    assert manager.all_steps() == [0]
    manager.save(2, tree(2))
    manager.wait()
    assert manager.all_steps() == [0, 2] and sorted(os.listdir(run)) == ["0", "2"]


KILLED_SAVER = """
import numpy as np, eqxckpt
manager = eqxckpt.CheckpointManager({directory!r})
manager.save(0, {{"w": np.zeros(3)}})
manager.wait()
print("committed 0", flush=True)
manager.save(1, {{f"leaf{{i}}": np.full((1024, 1024), i, np.float32) for i in range({leaves})}})
manager.wait()
"""


@pytest.mark.multiprocess
def test_restart_after_a_killed_save(tmp_path):
    for attempt, leaves in enumerate((64, 160, 320)):
        directory = tmp_path / f"run{attempt}"
        # killed while step 1 is half written
        kill_when(
            KILLED_SAVER.format(directory=str(directory), leaves=leaves),
            lambda d=directory: d.is_dir() and any(p.name.startswith(".1.eqxckpt-tmp-") for p in d.iterdir()),
        )
        if not (directory / "1").exists():
            break
    else:
        pytest.fail("the writer always committed step 1 before it could be killed")
    leftovers = [p.name for p in directory.iterdir() if p.name.startswith(".")]
    assert leftovers  # a real half-written step

    with pytest.raises(eqxckpt.IncompleteCheckpointError):
        eqxckpt.load(directory / "1")
    manager = eqxckpt.CheckpointManager(directory)
    assert manager.all_steps() == [0] and manager.latest_step() == 0
    assert sorted(os.listdir(directory)) == ["0"]  # cleaned up on open
    manager.save(1, {"w": np.ones(3)})  # the interrupted step saves again
    manager.wait()
    np.testing.assert_array_equal(manager.load()["w"], np.ones(3))


@pytest.mark.multiprocess
def test_resumed_training_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    worker = str(WORKERS / "training_worker.py")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    steps = 30
    reference = subprocess.run(
        [sys.executable, worker, str(tmp_path / "ref"), str(steps), "--keep-all"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert reference.returncode == 0, reference.stderr

    kill_at = random.Random().randint(2, steps - 3)
    run = subprocess.Popen(
        [sys.executable, worker, str(tmp_path / "run"), str(steps)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        for line in run.stdout:
            if line.strip() == f"saving {kill_at}":  # step kill_at's save is in flight
                run.send_signal(signal.SIGKILL)
                break
    finally:
        run.kill()
        run.wait()
    assert run.returncode == -signal.SIGKILL, f"not killed (kill_at={kill_at})"

    from training_worker import make_state

    interrupted = eqxckpt.CheckpointManager(tmp_path / "run")
    latest = interrupted.latest_step()
    assert latest is not None and kill_at - 2 <= latest <= kill_at, (kill_at, latest)
    reference_manager = eqxckpt.CheckpointManager(tmp_path / "ref")
    like = make_state()
    assert_trees_equal(interrupted.load(like), reference_manager.load(like, step=latest))

    resumed = subprocess.run(
        [sys.executable, worker, str(tmp_path / "run"), str(steps)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert resumed.returncode == 0 and f"resumed from {latest}" in resumed.stdout, resumed.stderr
    final = eqxckpt.CheckpointManager(tmp_path / "run")
    assert final.all_steps() == [steps - 2, steps - 1]
    assert_trees_equal(final.load(like), reference_manager.load(like, step=steps - 1))


def test_loads_never_fail_while_saves_and_deletions_run(tmp_path, monkeypatch):
    """A reader thread loads the latest step again and again while the manager
    saves new steps in the background and deletes old ones."""
    import threading

    from eqxckpt._read._checkpoint import Checkpoint

    real_read = Checkpoint.read

    def slow_read(*args):  # hold each load open long enough for several saves to commit
        time.sleep(0.02)
        return real_read(*args)

    monkeypatch.setattr(Checkpoint, "read", slow_read)
    big = lambda step: {"w": np.full((256, 1024), float(step), np.float32), "step": step}  # noqa: E731
    manager = eqxckpt.CheckpointManager(tmp_path, max_to_keep=1)
    manager.save(0, big(0))
    manager.wait()
    stop, results, errors = threading.Event(), [], []

    def reader():
        while not stop.is_set():
            try:
                got = manager.load(big(0))
                assert (got["w"] == got["step"]).all()  # never a mix of two steps
                results.append(got["step"])
            except Exception as e:  # noqa: BLE001 - collected and reported below
                errors.append(e)

    thread = threading.Thread(target=reader)
    thread.start()
    for step in range(1, 40):
        manager.save(step, big(step))
    manager.wait()
    stop.set()
    thread.join()
    assert not errors, errors[:3]
    assert len(results) >= 5 and len(set(results)) > 3
    assert manager.all_steps() == [39] and sorted(os.listdir(tmp_path)) == ["39"]  # deferred deletions happened


def test_a_load_racing_a_writer_is_retried_in_one_place(tmp_path, monkeypatch):
    """A read that keeps finding its checkpoint replaced is tried `READ_ATTEMPTS` times for
    a given step, `MAX_LATEST_ATTEMPTS` for the latest: the manager's retries, not those
    times `load`'s own (which a plain `eqxckpt.load` still makes)."""
    from eqxckpt._read._load import READ_ATTEMPTS, Plan
    from eqxckpt._run._tiers import MAX_LATEST_ATTEMPTS

    manager = eqxckpt.CheckpointManager(tmp_path, blocking=True)
    for step in range(2):
        manager.save(step, tree(step))
    reads = []

    def replaced_while_read(self, *_):
        reads.append(self)
        raise eqxckpt.CheckpointChangedError("replaced while it was read")

    monkeypatch.setattr(Plan, "run", replaced_while_read)
    for load, attempts in [
        (lambda: manager.load(step=0), READ_ATTEMPTS),
        (lambda: manager.load(), MAX_LATEST_ATTEMPTS),
        (lambda: eqxckpt.load(manager.path(1)), READ_ATTEMPTS),
    ]:
        reads.clear()
        with pytest.raises(eqxckpt.CheckpointChangedError):
            load()
        assert len(reads) == attempts


def test_a_load_of_the_latest_step_deleted_meanwhile_reads_the_newest_one(tmp_path):
    """Another process deleted the step this manager would pick, and committed a newer one."""
    trainer = eqxckpt.CheckpointManager(tmp_path, blocking=True)
    for step in range(3):
        trainer.save(step, tree(step))
    evaluator = eqxckpt.CheckpointManager(tmp_path)
    shutil.rmtree(tmp_path / "2")
    trainer.save(3, tree(3))
    assert evaluator.latest_step() == 2  # as listed when it opened
    assert_trees_equal(evaluator.load(), tree(3))
    assert evaluator.all_steps() == [0, 1, 3]
    shutil.rmtree(tmp_path / "3")
    with pytest.raises(eqxckpt.CheckpointNotFoundError):
        evaluator.load(step=3)  # a given step is not replaced by another


def test_metadata_docstring_example_runs(tmp_path):
    import textwrap

    example = textwrap.dedent(eqxckpt.CheckpointManager.metadata.__doc__.split("```python")[1].split("```")[0])
    with eqxckpt.CheckpointManager(tmp_path) as manager:
        exec(example, {"manager": manager, "tree": tree(100)})  # the example as written
        assert manager.metadata() == {"lr": 3e-4}


def _train(directory, steps, interval, *extra, stop_after=None):
    """Run tests/workers/preemption_worker.py; SIGTERM it once it prints ``step stop_after``."""
    worker = subprocess.Popen(
        [
            sys.executable,
            str(WORKERS / "preemption_worker.py"),
            str(directory),
            str(steps),
            str(interval),
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=WORKERS,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    lines = []
    for line in worker.stdout:
        lines.append(line.strip())
        if stop_after is not None and line.strip() == f"step {stop_after}":
            worker.send_signal(signal.SIGTERM)
    err = worker.stderr.read()
    assert worker.wait(timeout=300) == 0, err
    return lines, err


@pytest.mark.multiprocess
def test_sigterm_saves_the_current_step_and_the_rerun_resumes_bit_identically(tmp_path):
    from training_worker import make_state

    lines, err = _train(tmp_path / "run", 30, 10, stop_after=5)  # the interval saves steps 0, 10, 20
    assert "done" not in lines and "preemption notice" in err
    saved = eqxckpt.CheckpointManager(tmp_path / "run").all_steps()
    stopped = saved[-1]
    assert saved[0] == 0 and stopped >= 5 and f"step {stopped}" not in lines  # saved, then it exited
    assert eqxckpt.verify(tmp_path / "run" / str(stopped)).ok
    lines, _ = _train(tmp_path / "run", 30, 10)
    assert lines[0] == f"resumed from {stopped}" and lines[-1] == "done"
    _train(tmp_path / "reference", 30, 10)  # the same run, never stopped
    like = make_state()
    for step in (10, 20):  # after the stop, the resumed run computes exactly what the reference did
        assert_trees_equal(
            eqxckpt.CheckpointManager(tmp_path / "run").load(like, step=step),
            eqxckpt.CheckpointManager(tmp_path / "reference").load(like, step=step),
        )


@pytest.mark.multiprocess
def test_sigterm_during_a_save_in_progress(tmp_path):
    lines, err = _train(tmp_path / "run", 50, 1, "--big", stop_after=2)  # every step saves 64 MiB, blocking
    manager = eqxckpt.CheckpointManager(tmp_path / "run")
    last = manager.latest_step()
    assert "done" not in lines and "preemption notice" in err and last is not None and last >= 2
    assert all(eqxckpt.verify(tmp_path / "run" / str(step)).ok for step in manager.all_steps())
    lines, _ = _train(tmp_path / "run", last + 3, 1, "--big")
    assert lines[0] == f"resumed from {last}" and lines[-1] == "done"


@pytest.mark.multiprocess
def test_without_save_on_preemption_sigterm_is_left_alone(tmp_path):
    script = f"""
import os, signal, numpy as np, eqxckpt
manager = eqxckpt.CheckpointManager({str(tmp_path / "run")!r}, save_on_preemption=False)
manager.save(0, {{"w": np.zeros(2)}})
manager.wait()
os.kill(os.getpid(), signal.SIGTERM)
print("still running")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGTERM and "still running" not in done.stdout


def test_incremental_saves_link_unchanged_leaves_and_survive_retention(tmp_path):
    """A manager writes only the leaves that changed since its latest step: the others are
    hard links to that step's files. Deleting the step that first wrote them leaves every
    newer step whole; a leaf that changes dtype or shape, or changes back to an earlier
    value, is written, and loads as saved."""
    rng = np.random.default_rng(0)
    frozen = rng.standard_normal((512, 256)).astype(np.float32)  # over the packing size

    def state(step: int) -> dict:
        adapter = np.full((300, 300), step % 2, np.float32)  # 0, 1, 0, 1: back to an earlier value
        odd = np.zeros(70_000, np.float64 if step >= 3 else np.float32)  # dtype changes at step 3
        small = [np.full(4, i + (step >= 5), np.float32) for i in range(40)]  # packed; changes at step 5
        return {"frozen": frozen, "adapter": adapter, "odd": odd, "small": small, "step": step}

    run = tmp_path / "run"
    # One copy: every step shares with the latest (two copies: `test_kept_steps_hold_two_copies...`).
    with eqxckpt.CheckpointManager(run, max_to_keep=3, blocking=False, kept_copies=1) as manager:
        for step in range(6):
            manager.save(step, state(step), force=True)
    inode = lambda step, leaf, chunk="c/0/0": os.stat(run / str(step) / leaf / chunk).st_ino  # noqa: E731
    assert manager.all_steps() == [3, 4, 5] and not (run / "0").exists()  # the step that wrote `frozen` is gone
    assert len({inode(step, "frozen") for step in (3, 4, 5)}) == 1 and os.stat(run / "5/frozen/c/0/0").st_nlink == 3
    assert len({inode(step, "adapter") for step in (3, 4, 5)}) == 3  # 1, 0, 1: changed each time
    assert len({inode(step, "odd", "c/0") for step in (3, 4, 5)}) == 1  # written at 3 as float64, then linked
    assert inode(3, "%packed", "c/0") == inode(4, "%packed", "c/0") != inode(5, "%packed", "c/0")  # taken whole
    for step in (3, 4, 5):
        assert eqxckpt.verify(manager.path(step)).ok
        assert_trees_equal(eqxckpt.load(manager.path(step), state(step)), state(step))
    # Retention again: deleting 3 and 4 leaves 5 (and the new steps) whole.
    with eqxckpt.CheckpointManager(run, max_to_keep=1, blocking=True, kept_copies=1) as manager:
        manager.save(6, state(6))
    assert manager.all_steps() == [6] and os.stat(run / "6/frozen/c/0/0").st_nlink == 1
    assert_trees_equal(eqxckpt.load(manager.path(6), state(6)), state(6))
    assert eqxckpt.verify(manager.path(6)).ok


def test_a_leaf_is_linked_only_when_its_files_are_plain_and_as_expected(tmp_path):
    """save(base=...) takes nothing it cannot vouch for: a base whose leaf holds a symlink
    or a missing chunk has that leaf written again; across filesystems, files are copied."""
    x = np.arange(4096, dtype=np.float32).reshape(64, 64)
    eqxckpt.save(tmp_path / "a", {"x": x, "y": x + 1})
    chunk = tmp_path / "a/y/c/0/0"
    outside = tmp_path / "outside"
    outside.write_bytes(chunk.read_bytes())
    chunk.unlink()
    chunk.symlink_to(outside)
    eqxckpt.save(tmp_path / "b", {"x": x, "y": x + 1}, base=tmp_path / "a")
    assert os.stat(tmp_path / "b/x/c/0/0").st_ino == os.stat(tmp_path / "a/x/c/0/0").st_ino
    assert not os.path.islink(tmp_path / "b/y/c/0/0") and os.stat(tmp_path / "b/y/c/0/0").st_nlink == 1
    assert eqxckpt.verify(tmp_path / "b").ok
    # A leaf directory that is a link (to a copy of itself elsewhere) is not taken either.
    eqxckpt.save(tmp_path / "e", {"x": x})
    shutil.move(tmp_path / "e/x", tmp_path / "x_elsewhere")
    (tmp_path / "e/x").symlink_to(tmp_path / "x_elsewhere")
    eqxckpt.save(tmp_path / "d", {"x": x}, base=tmp_path / "e")
    assert os.stat(tmp_path / "d/x/c/0/0").st_nlink == 1 and not os.path.islink(tmp_path / "d/x")
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        return
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as other:
        with pytest.warns(UserWarning, match="copied instead of linked"):
            eqxckpt.save(pathlib.Path(other) / "c", {"x": x}, base=tmp_path / "a")
        assert os.stat(pathlib.Path(other) / "c/x/c/0/0").st_nlink == 1
        np.testing.assert_array_equal(eqxckpt.load(pathlib.Path(other) / "c")["x"], x)


def _flip_bit(data: bytes, at: int = 0) -> bytes:
    """``data`` with one bit of its byte ``at`` flipped (bit rot)."""
    return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]


def _rotting_state(step: int) -> dict:
    """A 512 KiB frozen leaf (one chunk, its own array), a leaf that changes every step (too
    large to be packed), and enough small frozen leaves to be packed."""
    frozen = np.random.default_rng(7).standard_normal(131072).astype(np.float32)
    small = [np.full(4, i, np.float32) for i in range(40)]
    return {"frozen": frozen, "adapter": np.full(70_000, step, np.float32), "small": small, "step": step}


@pytest.mark.parametrize("damaged", ["frozen/c/0", "%packed/c/0"])
def test_bit_rot_in_a_base_step_is_not_spread_into_later_steps(tmp_path, damaged):
    """Issue #37: one bit of step 0's frozen leaf (or of its packed small leaves) flips; steps
    1-3 are saved with the right values. Step 1 checks what it would share, finds it damaged,
    writes it afresh from the caller's values and says so; after retention, the kept steps
    hold what the caller saved."""
    run = tmp_path / "run"
    with eqxckpt.CheckpointManager(run, max_to_keep=2, blocking=True, kept_copies=1) as manager:
        manager.save(0, _rotting_state(0))
        chunk = run / "0" / damaged
        chunk.write_bytes(_flip_bit(chunk.read_bytes()))
        leaf = "frozen" if damaged.startswith("frozen") else "small/"
        with pytest.warns(UserWarning, match=rf"{re.escape(leaf)}.*{re.escape(str(run / '0'))}") as caught:
            manager.save(1, _rotting_state(1))
        assert len([w for w in caught if "damaged" in str(w.message)]) == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # step 1's copy is intact: shared without a word
            manager.save(2, _rotting_state(2))
            manager.save(3, _rotting_state(3))
    assert manager.all_steps() == [2, 3]
    assert os.stat(run / "2" / damaged).st_ino == os.stat(run / "3" / damaged).st_ino  # shared again from step 1
    for step in (2, 3):
        assert eqxckpt.verify(manager.path(step)).ok
        assert_trees_equal(eqxckpt.load(manager.path(step), _rotting_state(step)), _rotting_state(step))


def test_a_manager_that_is_not_incremental_shares_nothing(tmp_path):
    """incremental=False: every step writes every leaf; no file is shared between steps."""
    run = tmp_path / "run"
    with eqxckpt.CheckpointManager(run, blocking=True, incremental=False) as manager:
        for step in range(3):
            manager.save(step, _rotting_state(step))
    for leaf in ("frozen/c/0", "%packed/c/0"):
        assert len({os.stat(run / str(step) / leaf).st_ino for step in range(3)}) == 3
        assert all(os.stat(run / str(step) / leaf).st_nlink == 1 for step in range(3))
    for step in range(3):
        assert_trees_equal(eqxckpt.load(manager.path(step), _rotting_state(step)), _rotting_state(step))


def refused_and_kept(run, step: object) -> None:
    """The manager on ``run``, whose step 2 (at ``step``) holds a damaged manifest: warned
    about, not listed, and never saved over, by a resumed loop or by `save` itself."""
    with pytest.warns(UserWarning, match=r"skipped 1 entries .*2 \(ManifestError"):
        manager = eqxckpt.CheckpointManager(run)
    assert manager.all_steps() == [0, 1] and manager.latest_step() == 1
    with pytest.raises(eqxckpt.CheckpointExistsError, match="Step 2 of .* cannot be read .* never saves over it"):
        manager.save(manager.latest_step() + 1, tree(2))  # at once, though saves run in the background
    manager.save(3, tree(3))
    manager.wait()
    assert manager.all_steps() == [0, 1, 3]
    with pytest.raises(eqxckpt.ManifestError):
        eqxckpt.load(step)
    with pytest.raises(eqxckpt.CheckpointExistsError, match="damaged manifest|already exists"):
        eqxckpt.save(step, tree(2))


def test_a_step_with_a_damaged_manifest_is_named_and_never_saved_over(store):
    """One hex digit of "arrays" changed in step 2's manifest, its checksum computed again
    (so that what is tested is the arrays it names): it names arrays that do not exist,
    beside the intact ones it should name. Warned about, never saved over without
    overwrite=True; an overwrite replaces the manifest and leaves the arrays alone."""
    top = f"damaged-{store.name}/"
    run = store.spec(top)
    with eqxckpt.CheckpointManager(run, blocking=True) as manager:
        for step in range(3):
            manager.save(step, tree(step))
    before = store.keys(top + "2/")
    manifest = manifest_doc(store.get(top + "2/eqxckpt.json"))
    intact = manifest["arrays"]
    manifest["arrays"] = intact[:-1] + ("0" if intact[-1] != "0" else "1")
    store.put(top + "2/eqxckpt.json", crafted_manifest(manifest))
    step = {**run, "path": top + "2/"}
    refused_and_kept(run, step)
    assert store.keys(top + "2/") == before
    eqxckpt.save(step, tree(9), overwrite=True)
    assert_trees_equal(eqxckpt.load(step), tree(9))
    assert [key for key in store.keys(top + "2/") if intact in key] == [k for k in before if intact in k]


def flip_save_id(raw: bytes) -> bytes:
    at = raw.index(b'"save_id": "') + len(b'"save_id": "')
    return raw[:at] + bytes([raw[at] ^ 1]) + raw[at + 1 :]  # still a hex digit, or a letter


@pytest.mark.parametrize("damage", [lambda raw: raw[:-20], flip_save_id], ids=["cut short", "one bit flipped"])
def test_a_step_with_a_damaged_manifest_on_a_local_disk(tmp_path, damage):
    """The same on a local disk, with step 2's manifest cut short, or one bit of it flipped
    (still valid JSON: its checksum tells)."""
    run = tmp_path / "run"
    with eqxckpt.CheckpointManager(run, blocking=True) as manager:
        for step in range(3):
            manager.save(step, tree(step))
    manifest = run / "2" / "eqxckpt.json"
    manifest.write_bytes(damage(manifest.read_bytes()))
    before = {str(p): p.read_bytes() for p in (run / "2").rglob("*") if p.is_file()}
    refused_and_kept(run, run / "2")
    assert {str(p): p.read_bytes() for p in (run / "2").rglob("*") if p.is_file()} == before


@pytest.mark.parametrize(
    "kwargs, match",
    [({"metrics": {"loss": "x"}}, "loss|metric"), ({"metadata": {"a": object()}}, "metadata")],
)
def test_bad_arguments_to_a_managers_save_are_argument_errors(tmp_path, kwargs, match):
    # metrics={"loss": "x"} raised float()'s bare ValueError; bad metadata a plain CheckpointError.
    with eqxckpt.CheckpointManager(tmp_path / "run", blocking=True) as manager:
        with pytest.raises(eqxckpt.ArgumentError, match=match):
            manager.save(0, {"w": np.ones(3, np.float32)}, **kwargs)


FORK_DURING_A_SAVE = r"""
import os, signal, sys, threading, numpy as np, eqxckpt
from eqxckpt._write._background import SAVES

manager = eqxckpt.CheckpointManager(sys.argv[1])
manager.save(0, {"w": np.arange(1 << 20, dtype=np.float32)})
release = threading.Event()
SAVES.submit("held", release.wait)  # after the save, on its thread: in flight until the child is done
pid = os.fork()
if pid == 0:  # a data loader's worker: it never saves, and ends as a script does
    signal.alarm(30)  # a hang at exit ends here, as SIGALRM
    # eqxckpt's exit handler, as sys.exit runs it, then out: JAX's own exit handlers in a
    # child forked from its threads may crash (SIGSEGV), which is JAX's, not this test's.
    SAVES.finish_at_exit()
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), flush=True)
release.set()
manager.wait()
print("parent", manager.all_steps(), flush=True)
"""


@pytest.mark.multiprocess
def test_a_child_forked_during_a_background_save_exits(tmp_path):
    """#53 item 1: a child forked while a background save was in flight waited at exit
    for the parent's save, whose thread is not in the child: it never ended."""
    done = subprocess.run(
        [sys.executable, "-c", FORK_DURING_A_SAVE, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert done.stdout.splitlines() == ["child 0", "parent [0]"], done.stderr[-3000:]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    max_to_keep=st.sampled_from([1, 2, 3, 5, None]),
    keep_every=st.sampled_from([None, 2, 3]),
    steps=st.integers(2, 9),
    changes=st.sets(st.integers(1, 8), max_size=2),
)
def test_kept_steps_hold_two_copies_of_every_leaf(tmp_path_factory, max_to_keep, keep_every, steps, changes):
    """With the default ``kept_copies=2``, once two or more steps are kept no single file
    holds a leaf for every kept step, whatever the retention (a backbone frozen, changed
    now and then): one flipped bit leaves a twin to mend from. With 1, every step shares
    the latest's."""
    run = tmp_path_factory.mktemp("copies") / "run"
    version = 0
    with eqxckpt.CheckpointManager(run, max_to_keep=max_to_keep, keep_every=keep_every, blocking=True) as manager:
        for step in range(steps):
            version += step in changes
            state = {"backbone": np.full((64, 64), version, np.float32), "head": np.full(300, step, np.float32)}
            manager.save(step, state)
            kept = manager.all_steps()
            files = {os.stat(run / str(s) / "backbone" / "c" / "0" / "0").st_ino for s in kept}
            assert len(kept) < 2 or len(files) >= 2, (step, kept)
            assert_trees_equal(eqxckpt.load(manager.path(step), state), state)


@pytest.mark.parametrize("claimed", [None, 10**30, -1, 5])
def test_a_step_no_manager_grouped_never_leaves_one_copy_behind_the_kept_steps(tmp_path, claimed):
    """The sixteenth and seventeenth outside attacks: step 2, saved by an older eqxckpt (no
    group in its record) or by another tool (a group outside ``range(kept_copies)``), links
    step 1's files; the next steps then joined step 1's group and linked them too, so one
    file stood behind every kept step. Such a step counts for none: the next writes its own
    copy, and after every save the kept steps hold two."""
    run = tmp_path / "run"
    frozen = np.arange(70_000, dtype=np.float32)
    state = lambda step: {"frozen": frozen, "moving": np.full(70_000, step, np.float32)}  # noqa: E731
    with eqxckpt.CheckpointManager(run, max_to_keep=2, blocking=True) as manager:
        manager.save(0, state(0))
        manager.save(1, state(1))
    record = {"step": 2, "metrics": {}} | ({} if claimed is None else {"copy": claimed})
    eqxckpt.save(run / "2", state(2), base=run / "1", metadata={"eqxckpt.manager": record})
    inode = lambda step: os.stat(run / str(step) / "frozen" / "c" / "0").st_ino  # noqa: E731
    assert inode(1) == inode(2)
    with eqxckpt.CheckpointManager(run, max_to_keep=2, blocking=True) as manager:
        for step in range(3, 7):
            manager.save(step, state(step))
            assert len({inode(kept) for kept in manager.all_steps()}) == 2, (step, manager.all_steps())


def test_kept_copies_changed_back_to_two_makes_two_copies_again(tmp_path):
    """The eighteenth outside attack: a step saved with ``kept_copies=1`` was put in group 0
    while it linked the newest step's files (group 1's); saved with 2 again, both groups
    looked held and one file stood behind every kept step for good. A step that shares
    the newest's files is in its group."""
    run = tmp_path / "run"
    frozen = np.arange(70_000, dtype=np.float32)
    inode = lambda step: os.stat(run / str(step) / "frozen" / "c" / "0").st_ino  # noqa: E731
    for steps, copies in ((range(0, 2), 2), (range(2, 3), 1), (range(3, 7), 2)):
        with eqxckpt.CheckpointManager(run, max_to_keep=2, blocking=True, kept_copies=copies) as manager:
            for step in steps:
                manager.save(step, {"frozen": frozen, "moving": np.full(70_000, step, np.float32)})
                if copies == 2 and step:
                    assert len({inode(kept) for kept in manager.all_steps()}) == 2, (step, manager.all_steps())
