"""Several real processes on one checkpoint directory (local disk and S3 on moto).

Each test starts workers (tests/concurrency_worker.py) that race each other;
``--slow`` runs many more rounds. A worker fails the test by exiting non-zero
(a mixed tree, a raw exception, a save that fails).
"""

import json
import os
import subprocess
import sys

import pytest
from conftest import s3_spec

import eqxckpt

TESTS = os.path.dirname(__file__)
WORKER = os.path.join(TESTS, "concurrency_worker.py")
sys.path.insert(0, TESTS)
from concurrency_worker import one_save, state  # noqa: E402


def rounds(request, fast: int, slow: int) -> int:
    return slow if request.config.getoption("--slow") else fast


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_worker_outlives_its_test():
    """A failing test must not leave workers behind (on S3 they would retry a stopped server)."""
    yield
    while STARTED:
        worker = STARTED.pop()
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def start(role: str, where, *args, leaves: int = 100) -> subprocess.Popen:
    target = json.dumps(where) if isinstance(where, dict) else str(where)
    env = dict(os.environ, JAX_PLATFORMS="cpu", EQXCKPT_TEST_LEAVES=str(leaves))
    worker = subprocess.Popen(
        [sys.executable, WORKER, role, target, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    STARTED.append(worker)
    return worker


def finish(worker: subprocess.Popen, timeout: float = 300) -> dict:
    out, _ = worker.communicate(timeout=timeout)
    assert worker.returncode == 0, out[-4000:]
    [line] = [line for line in out.splitlines() if line.startswith("summary ")]
    return json.loads(line[len("summary ") :])


def check_run(run, expected_latest: int) -> list[int]:
    """Every step left in the run loads as its own state and verifies; no leftovers."""
    manager = eqxckpt.CheckpointManager(run)
    steps = manager.all_steps()
    assert steps and steps[-1] == expected_latest, steps
    for step in steps:
        assert one_save(manager.load(step=step)) == step
        report = eqxckpt.verify(manager.path(step))
        assert report.ok, report
    if not isinstance(run, dict):
        assert not [name for name in os.listdir(run) if name.startswith(".")], os.listdir(run)
    return steps


def evaluate_while_training(request, tmp_path, run, keep: int, steps: int, leaves: int, evaluators: int = 2):
    stop = tmp_path / "stop"
    stop.unlink(missing_ok=True)
    trainer = start("train", run, steps, keep, leaves=leaves)
    readers = [start("evaluate", run, stop, leaves=leaves) for _ in range(evaluators)]
    try:
        trained = finish(trainer)
    finally:
        stop.touch()
    summaries = [finish(reader) for reader in readers]
    print("trainer:", trained, "evaluators:", summaries)  # the counts, for the record (-s)
    return trained, summaries


@pytest.mark.parametrize("keep", [1, 0])
def test_evaluators_polling_a_manager_never_break_the_trainer(tmp_path, request, keep):
    """Item 1 of the concurrency issue: opening managers on a run while it saves
    (with max_to_keep=1, or keeping every step so each can be checked after)."""
    steps = 12
    for round_ in range(rounds(request, 1, 10)):
        run = tmp_path / f"run{round_}"
        trained, _ = evaluate_while_training(request, tmp_path, run, keep, steps, leaves=100)
        assert trained["steps"] == ([steps - 1] if keep == 1 else list(range(steps)))
        kept = check_run(run, steps - 1)
        if keep == 0:
            assert kept == list(range(steps))  # every committed step is whole


def test_evaluators_polling_a_manager_on_s3(s3, tmp_path, request):
    endpoint, _ = s3
    for round_ in range(rounds(request, 1, 4)):
        run = s3_spec(endpoint, f"conc/eval{round_}/")
        trained, _ = evaluate_while_training(request, tmp_path, run, 1, 6, leaves=20)
        assert trained["steps"] == [5]
        check_run(run, 5)


def overwrite_while_reading(tmp_path, where, writes: int, leaves: int) -> dict:
    stop = tmp_path / "stop-reading"
    stop.unlink(missing_ok=True)
    eqxckpt.save(where, state(0, leaves))
    writer = start("overwrite", where, writes, leaves=leaves)
    reader = start("read", where, stop, leaves=leaves)
    try:
        finish(writer)
    finally:
        stop.touch()
    summary = finish(reader)
    print("reader:", summary)
    assert one_save(eqxckpt.load(where)) == writes  # the last save is what stays
    return summary


def test_loads_during_overwrites_return_one_save_or_say_it_changed(tmp_path, request):
    """Item 3: every load returns the values of exactly one save (the reader
    process checks every leaf), or raises CheckpointChangedError."""
    for round_ in range(rounds(request, 1, 10)):
        overwrite_while_reading(tmp_path, tmp_path / f"ckpt{round_}", writes=25, leaves=100)


def test_loads_during_overwrites_on_s3(s3, tmp_path, request):
    endpoint, _ = s3
    for round_ in range(rounds(request, 1, 4)):
        overwrite_while_reading(tmp_path, s3_spec(endpoint, f"conc/over{round_}/"), writes=6, leaves=20)


def test_two_managers_in_two_processes_save_into_one_run(tmp_path, request):
    """Item 6: two trainers on one directory. Each step is committed once, the
    other save gets a CheckpointExistsError; no raw exception, no broken step."""
    steps = 10
    for round_ in range(rounds(request, 1, 10)):
        run = tmp_path / f"run{round_}"
        rivals = [start("rival", run, steps) for _ in range(2)]
        summaries = [finish(rival) for rival in rivals]
        print("rivals:", summaries)
        for summary in summaries:
            assert sum(summary["counts"].values()) == steps, summary
        assert sum(s["counts"].get("committed", 0) for s in summaries) >= steps
        check_run(run, steps - 1)


def test_two_managers_on_s3(s3, request):
    endpoint, _ = s3
    for round_ in range(rounds(request, 1, 4)):
        run = s3_spec(endpoint, f"conc/rivals{round_}/")
        summaries = [finish(rival) for rival in [start("rival", run, 5, leaves=10) for _ in range(2)]]
        for summary in summaries:
            assert sum(summary["counts"].values()) == 5, summary
        check_run(run, 4)


def test_odd_entries_never_stop_a_run_from_opening(tmp_path):
    """Item 5: a copy named 007, a directory named ², a damaged manifest, a file:
    skipped with one warning naming each; resume picks the newest good step."""
    run = tmp_path / "run"
    with eqxckpt.CheckpointManager(run, blocking=True) as manager:
        for step in (1, 2, 3):
            manager.save(step, state(step))
    eqxckpt.save(run / "007", state(7))
    eqxckpt.save(run / "²", state(8))
    (run / "3" / "eqxckpt.json").write_text("{ damaged")
    (run / "notes.txt").write_text("mine")
    (run / "9").mkdir()
    with pytest.warns(UserWarning) as caught:
        manager = eqxckpt.CheckpointManager(run, max_to_keep=2, blocking=True)
    [warning] = [w for w in caught if "skipped" in str(w.message)]
    for name in (
        "007 (not a step number)",
        "² (not a step number)",
        "3 (ManifestError",
        "notes.txt",
        "9 (no committed",
    ):
        assert name in str(warning.message), warning.message
    assert manager.all_steps() == [1, 2] and manager.latest_step() == 2
    assert one_save(manager.load(state(0))) == 2
    manager.save(4, state(4))  # retention never touches what is not a step of its own
    assert manager.all_steps() == [2, 4]
    assert sorted(os.listdir(run)) == ["007", "2", "3", "4", "9", "notes.txt", "²"]


@pytest.mark.parametrize("leaves, trigger", [(8, 3), (64, 1)])  # arrays of their own; packed
def test_a_step_deleted_during_a_load_is_a_clear_error(tmp_path, monkeypatch, leaves, trigger):
    """Item 6: a leaf check that finds the step gone raises CheckpointChangedError
    (the load is pinned to the directory it opened), never FileNotFoundError."""
    from eqxckpt._local import LocalStorage

    run = tmp_path / "run"
    eqxckpt.save(run / "1", state(1, leaves))
    real = LocalStorage.stored_bytes
    calls = []

    def delete_midway(root, record):
        calls.append(record.path)
        if len(calls) == trigger:  # another process deletes the step while this one reads it
            os.rename(run / "1", run / ".gone")
        return real(root, record)

    monkeypatch.setattr(LocalStorage, "stored_bytes", delete_midway)
    monkeypatch.setattr(eqxckpt._load, "READ_ATTEMPTS", 1)
    with pytest.raises(eqxckpt.CheckpointChangedError, match="replaced or deleted by another process"):
        eqxckpt.load(run / "1", state(0, leaves))


def test_retention_waits_for_a_reader_in_another_process(tmp_path):
    """A step being read (a shared lock, here held by a child process) is not
    deleted by retention; the manager deletes it once the reader is done."""
    run = tmp_path / "run"
    manager = eqxckpt.CheckpointManager(run, max_to_keep=1, blocking=True)
    manager.save(1, state(1))
    hold = (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY); "
        "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); sys.stdin.readline()"
    )
    reader = subprocess.Popen(
        [sys.executable, "-c", hold, str(run / "1")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert reader.stdout.readline().strip() == "held"
        manager.save(2, state(2))
        assert manager.all_steps() == [2] and sorted(os.listdir(run)) == ["1", "2"]  # 1 waits for its reader
        assert one_save(eqxckpt.load(run / "1")) == 1
    finally:
        reader.communicate("done\n")
    manager.save(3, state(3))
    assert sorted(os.listdir(run)) == ["3"]


@pytest.mark.parametrize("option", ["size=6m", "nr_inodes=60"], ids=["bytes", "inodes"])
def test_disk_full_leaves_no_temporary_directory(tmp_path, request, option):
    """A save that fills the disk (its bytes or its inodes) fails with CheckpointWriteError,
    and removes its temporary directory once every write in flight has settled.

    The small tmpfs lives in a mount namespace of the worker's own (``unshare``),
    as root or, for other users, as root of a new user namespace."""
    mount = tmp_path / "small"
    mount.mkdir()
    namespace = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]
    rounds_ = rounds(request, 4, 40)
    done = subprocess.run(
        [*namespace, sys.executable, os.path.join(TESTS, "disk_full_worker.py"), option, str(mount), str(rounds_)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == f"rounds {rounds_}"
    assert os.listdir(mount) == []  # the tmpfs was the worker's alone
