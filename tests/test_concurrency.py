"""Several real processes on one checkpoint directory (local disk and S3 on moto).

Each test starts workers (tests/workers/concurrency_worker.py) that race each other;
``--slow`` runs many more rounds. A worker fails the test by exiting non-zero
(a mixed tree, a raw exception, a save that fails).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from concurrency_worker import one_save, state
from conftest import WORKERS, manifest_doc, s3_spec

import eqxckpt

pytestmark = pytest.mark.multiprocess  # every test here starts worker processes

WORKER = os.path.join(WORKERS, "concurrency_worker.py")


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
    """Evaluators open managers on a run while it saves
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
    """Every load returns the values of exactly one save (the reader
    process checks every leaf), or raises CheckpointChangedError."""
    for round_ in range(rounds(request, 1, 10)):
        overwrite_while_reading(tmp_path, tmp_path / f"ckpt{round_}", writes=25, leaves=100)


def test_loads_during_overwrites_on_s3(s3, tmp_path, request):
    endpoint, _ = s3
    for round_ in range(rounds(request, 1, 4)):
        overwrite_while_reading(tmp_path, s3_spec(endpoint, f"conc/over{round_}/"), writes=6, leaves=20)


def test_two_managers_in_two_processes_save_into_one_run(tmp_path, request):
    """Two trainers on one directory. Each step is committed once, the
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
    endpoint, client = s3
    for round_ in range(rounds(request, 1, 4)):
        run = s3_spec(endpoint, f"conc/rivals{round_}/")
        summaries = [finish(rival) for rival in [start("rival", run, 5, leaves=10) for _ in range(2)]]
        for summary in summaries:
            assert sum(summary["counts"].values()) == 5, summary
        check_run(run, 4)
        assert_only_live_prefixes(client, f"conc/rivals{round_}/")


# --- compare-and-swap commits on S3 (moto enforces If-Match / If-None-Match) ----------------


def prefixes(client, prefix: str) -> set[str]:
    """The saves' own prefixes (``%arrays.<hex>``) directly under ``prefix``."""
    listing = client.list_objects_v2(Bucket="eqxckpt-test", Prefix=prefix).get("Contents", [])
    return {obj["Key"][len(prefix) :].split("/")[0] for obj in listing} - {"eqxckpt.json", "eqxckpt.lease.json"}


def assert_only_live_prefixes(client, run: str) -> None:
    """Each entry of the run holds its committed save's prefix and, beside it, only
    prefixes that committed steps refer to (the frozen leaf, kept by incremental saves)."""
    listing = client.list_objects_v2(Bucket="eqxckpt-test", Prefix=run).get("Contents", [])
    manifests = [obj["Key"] for obj in listing if obj["Key"].endswith("/eqxckpt.json") and "%" not in obj["Key"]]
    live: set[str] = set()
    for key in manifests:
        manifest = manifest_doc(client.get_object(Bucket="eqxckpt-test", Key=key)["Body"].read())
        entry = key[len(run) :].split("/")[0]
        live.add(f"{entry}/{manifest['arrays']}")
        live |= {leaf["arrays"][3:] for leaf in manifest["leaves"] if "arrays" in leaf}
    found = {"/".join(obj["Key"][len(run) :].split("/")[:2]) for obj in listing if "/%arrays." in obj["Key"]}
    assert found == live


def committed_state(where) -> int:
    """The step of the one save a place holds, after checking every leaf and verifying it."""
    step = one_save(eqxckpt.load(where))
    report = eqxckpt.verify(where)
    assert report.ok, report
    return step


@pytest.mark.parametrize("overwrite", [0, 1])
def test_many_processes_committing_one_place_commit_once(s3, request, overwrite):
    """Four processes save to one place at once: without overwrite exactly one commits and
    the others are refused; with it, each commits whole or is refused. Either way the
    place holds one save's values and only that save's keys."""
    endpoint, client = s3
    for round_ in range(rounds(request, 1, 20)):
        prefix = f"cas/many{overwrite}-{round_}/"
        racers = [start("commit", s3_spec(endpoint, prefix), step, overwrite, leaves=16) for step in range(1, 5)]
        outcomes = [finish(racer)["outcome"] for racer in racers]
        print(outcomes)
        assert set(outcomes) <= {"committed", "CheckpointExistsError", "CheckpointBusyError"}, outcomes
        winners = [step for step, outcome in zip(range(1, 5), outcomes) if outcome == "committed"]
        assert len(winners) == 1 if not overwrite else len(winners) >= 1, outcomes
        assert committed_state(s3_spec(endpoint, prefix)) in winners
        assert len(prefixes(client, prefix)) == 1  # the losers removed what they wrote


PAUSED_WRITER = """
import eqxckpt, numpy as np, sys
where = {spec!r}
try:
    eqxckpt.save(where, {{f"leaf{{i}}": np.full((512, 512), 1.0, np.float32) for i in range(64)}}, overwrite=True)
except eqxckpt.CheckpointBusyError as e:
    print("refused:", e)
    sys.exit(3)
print("committed")
"""


def test_a_writer_paused_past_its_lease_never_lands_in_a_newer_checkpoint(s3, request, monkeypatch):
    """A writer stopped (SIGSTOP) at a chosen moment of its save, for longer than its lease;
    another writer reclaims the place and commits; the first resumes. Before prefixes of
    their own, 2 to 25 of 64 leaves of the committed checkpoint held the paused writer's
    data. Now: the newer checkpoint is whole and verifies, and the paused writer either
    committed before it stopped or is refused, leaving nothing behind."""
    import signal
    import time

    endpoint, client = s3
    monkeypatch.setenv("EQXCKPT_LEASE_TIMEOUT_S", "2")
    outcomes = []
    for round_ in range(rounds(request, 1, 20)):
        prefix = f"cas/paused{round_}/"
        where = s3_spec(endpoint, prefix)
        # Other leaf names than the writers': the chunks counted below are the paused writer's.
        eqxckpt.save(where, {f"old{i}": np.full((512, 512), 0.0, np.float32) for i in range(64)})
        writer = subprocess.Popen(
            [sys.executable, "-c", PAUSED_WRITER.format(spec=where)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )
        STARTED.append(writer)
        stop_after = 1 + (round_ * 37) % 64  # a different moment each round: early uploads to the commit
        deadline = time.monotonic() + 120
        while writer.poll() is None and time.monotonic() < deadline:
            listing = client.list_objects_v2(Bucket="eqxckpt-test", Prefix=prefix).get("Contents", [])
            if sum("/leaf" in obj["Key"] and obj["Key"].endswith("/c/0/0") for obj in listing) >= stop_after:
                break
        writer.send_signal(signal.SIGSTOP)
        time.sleep(2.5)  # past its lease's timeout
        eqxckpt.save(where, {f"leaf{i}": np.full((512, 512), 2.0, np.float32) for i in range(64)}, overwrite=True)
        writer.send_signal(signal.SIGCONT)
        out, _ = writer.communicate(timeout=120)
        outcomes.append(writer.returncode)
        assert writer.returncode in (0, 3), out[-3000:]
        loaded = eqxckpt.load(where)
        values = {float(np.asarray(v).reshape(-1)[0]) for v in loaded.values()}
        assert all((np.asarray(v) == 2.0).all() for v in loaded.values()), sorted(values)
        assert eqxckpt.verify(where).ok
        assert len(prefixes(client, prefix)) == 1  # the refused writer removed its own prefix
    print("paused writer: committed before the pause", outcomes.count(0), "refused", outcomes.count(3))


def test_retention_racing_saves_to_the_same_steps(s3, request):
    """A manager keeping 3 steps deletes old ones while another process saves the same
    steps (overwrite=True). Every step that remains is one save's values and verifies;
    each holds one prefix of arrays."""
    endpoint, client = s3
    for round_ in range(rounds(request, 1, 20)):
        run = s3_spec(endpoint, f"cas/retention{round_}/")
        trainer = start("rival", run, 8, leaves=10)
        other = start("steps", run, 8, leaves=10)
        print(finish(trainer), finish(other))
        manager = eqxckpt.CheckpointManager(run)
        for step in manager.all_steps():
            assert committed_state(manager.path(step)) == step
        assert_only_live_prefixes(client, f"cas/retention{round_}/")


def test_odd_entries_never_stop_a_run_from_opening(tmp_path):
    """A copy named 007, a directory named ², a damaged manifest, a file:
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
    """A leaf check that finds the step gone raises CheckpointChangedError
    (the load is pinned to the directory it opened), never FileNotFoundError."""
    from eqxckpt._storage._disk import LocalStorage

    run = tmp_path / "run"
    eqxckpt.save(run / "1", state(1, leaves))
    real = LocalStorage.check_leaf_files
    calls = []

    def delete_midway(root, record):
        calls.append(record.path)
        if len(calls) == trigger:  # another process deletes the step while this one reads it
            os.rename(run / "1", run / ".gone")
        return real(root, record)

    monkeypatch.setattr(LocalStorage, "check_leaf_files", delete_midway)
    monkeypatch.setattr(eqxckpt._read._load, "READ_ATTEMPTS", 1)
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
        [*namespace, sys.executable, os.path.join(WORKERS, "disk_full_worker.py"), option, str(mount), str(rounds_)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == f"rounds {rounds_}"
    assert os.listdir(mount) == []  # the tmpfs was the worker's alone
