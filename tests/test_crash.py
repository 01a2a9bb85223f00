"""Fault injection: real writer processes killed with SIGKILL at random moments.

After every kill the previous checkpoint loads bit-exact, the interrupted one is
complete and exact or refused as incomplete (never partly loaded), and a new save
to the same place succeeds. ``pytest --slow`` runs many more trials.
"""

import concurrent.futures
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import WORKERS, assert_trees_equal, manifest_doc
from crash_writer import state

import eqxckpt
from eqxckpt._storage._stamps import BOOK_NAME

pytestmark = pytest.mark.multiprocess  # every test here starts worker processes

WRITER = WORKERS / "crash_writer.py"
MODES = ["sync", "async", "manager", "fresh"]


def run_and_kill(directory: pathlib.Path | str, mode: str, delay: float) -> int:
    """Start a writer, SIGKILL it ``delay`` seconds after its first commit; return the last step it reported."""
    writer = subprocess.Popen(
        [sys.executable, str(WRITER), str(directory), mode],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    committed = []
    timer = None
    try:
        for line in writer.stdout:
            committed.append(int(line.split()[1]))
            if timer is None:
                timer = threading.Timer(delay, writer.send_signal, (signal.SIGKILL,))
                timer.start()
    finally:
        if timer is not None:
            timer.join()
        writer.kill()
        writer.wait()
    assert writer.returncode == -signal.SIGKILL and committed, f"{mode}: writer ended on its own"
    return committed[-1]


def expect_step(tree, step):
    assert tree["step"] == step
    assert_trees_equal(tree, state(step))


def check_after_kill(directory: pathlib.Path, mode: str, last: int) -> str:
    """The invariants; returns what the kill interrupted, for the tally."""
    if mode in ("sync", "async"):
        # Replaced atomically: always one complete checkpoint, the last or the one in flight.
        mid_save = any(name.startswith(".ckpt.eqxckpt-tmp-") for name in os.listdir(directory))
        found = eqxckpt.load(directory / "ckpt", state(0))["step"]
        assert found in (last, last + 1), (found, last)
        expect_step(eqxckpt.load(directory / "ckpt", state(0)), found)
        eqxckpt.save(directory / "ckpt", state(10**5), overwrite=True)
        expect_step(eqxckpt.load(directory / "ckpt", state(0)), 10**5)
        return ("in-flight save committed" if found == last + 1 else "previous kept") + (
            " (killed mid-write)" if mid_save else ""
        )
    if mode == "manager":
        manager = eqxckpt.CheckpointManager(directory / "run", max_to_keep=2)
        steps = manager.all_steps()
        assert steps and steps[-1] in (last, last + 1) and set(steps) <= {last - 1, last, last + 1}, (steps, last)
        for step in steps:
            expect_step(manager.load(state(0), step=step), step)
        # Leftovers cleaned on open; the run's stamp book stays (what its links did to its files).
        assert all(name.isdigit() or name == BOOK_NAME for name in os.listdir(directory / "run"))
        manager.save(steps[-1] + 1, state(steps[-1] + 1))
        manager.wait()
        expect_step(manager.load(state(0)), steps[-1] + 1)
        # The unchanged leaf is two files, one for each group of the two kept steps, whatever
        # the kill interrupted and whichever steps retention deleted since.
        frozen = {os.stat(directory / "run" / str(step) / "frozen/c/0/0").st_ino for step in manager.all_steps()}
        assert len(manager.all_steps()) == 2 and len(frozen) == 2, frozen  # a copy for each group
        return "in-flight save committed" if steps[-1] == last + 1 else "previous kept"
    # fresh paths: every reported one is complete; the interrupted one is all or nothing
    for step in range(1, last + 1):
        expect_step(eqxckpt.load(directory / f"ckpt_{step}", state(0)), step)
    interrupted = directory / f"ckpt_{last + 1}"
    try:
        expect_step(eqxckpt.load(interrupted, state(0)), last + 1)
        outcome = "in-flight save committed"
    except (eqxckpt.IncompleteCheckpointError, eqxckpt.CheckpointNotFoundError):
        outcome = "interrupted save refused"
    eqxckpt.save(interrupted, state(last + 1), overwrite=True)
    expect_step(eqxckpt.load(interrupted, state(0)), last + 1)
    return outcome


def test_kill_writers_at_random_moments(tmp_path, request):
    trials = 500 if request.config.getoption("--slow") else 12  # 3 per mode, at random moments each run
    rng = random.Random()
    seed = rng.randrange(10**9)
    rng.seed(seed)
    plan = [(i, MODES[i % len(MODES)], rng.uniform(0.0, 0.6)) for i in range(trials)]

    def trial(args):
        i, mode, delay = args
        directory = tmp_path / f"trial{i}"
        last = run_and_kill(directory, mode, delay)
        return mode, check_after_kill(directory, mode, last)

    tally: dict = {}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for mode, outcome in pool.map(trial, plan):
            tally.setdefault(mode, {}).setdefault(outcome, 0)
            tally[mode][outcome] += 1
    summary = {"seed": seed, "trials": trials, "all correct": True, "outcomes": tally}
    print("crash trials:", json.dumps(summary))
    assert sum(sum(v.values()) for v in tally.values()) == trials


def test_kill_an_incremental_manager_on_s3_at_random_moments(s3, request, monkeypatch):
    """A manager on S3 whose steps refer to an unchanged leaf in an earlier step's prefix,
    killed at a random moment (holding, saving, committing, deleting). Once the killed
    save's lease is stale, a new manager finishes what it left: every step loads
    bit-exact, the next save and its retention work, and every prefix left in the run is
    a committed step's own or one that committed steps refer to."""
    endpoint, client = s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("EQXCKPT_LEASE_TIMEOUT_S", "2")  # the killed writer's lease goes stale soon
    trials = 40 if request.config.getoption("--slow") else 3
    rng = random.Random()
    seed = rng.randrange(10**9)
    rng.seed(seed)
    outcomes: dict = {}
    for i in range(trials):
        top = f"crash-{seed}/trial{i}/run/"
        last = run_and_kill(f"s3://eqxckpt-test/crash-{seed}/trial{i}", "manager", rng.uniform(0.0, 1.0))
        time.sleep(2.5)
        manager = eqxckpt.CheckpointManager(f"s3://eqxckpt-test/{top}", max_to_keep=2)  # cleans up on open
        steps = manager.all_steps()
        assert steps and steps[-1] in (last, last + 1) and set(steps) <= {last - 1, last, last + 1}, (steps, last)
        manager.save(steps[-1] + 1, state(steps[-1] + 1))
        manager.wait()
        for step in manager.all_steps():
            expect_step(manager.load(state(0), step=step), step)
        listing = [o["Key"][len(top) :] for o in client.list_objects_v2(Bucket="eqxckpt-test", Prefix=top)["Contents"]]
        live = set()
        for step in manager.all_steps():
            manifest = manifest_doc(
                client.get_object(Bucket="eqxckpt-test", Key=f"{top}{step}/eqxckpt.json")["Body"].read()
            )
            live |= {f"{step}/{manifest['arrays']}"} | {
                leaf["arrays"][3:] for leaf in manifest["leaves"] if "arrays" in leaf
            }
        assert {"/".join(key.split("/")[:2]) for key in listing if "/%arrays." in key} == live
        # Stored twice: a copy for each group of the two kept steps.
        assert len({key.split("/")[0] for key in listing if key.endswith("/frozen/zarr.json")}) == 2
        outcome = "in-flight save committed" if steps[-1] == last + 1 else "previous kept"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print("s3 manager kills:", json.dumps({"seed": seed, "trials": trials, "outcomes": outcomes}))


INTERRUPTED = """
import sys
import numpy as np, eqxckpt
path, overwrite = sys.argv[1], sys.argv[2] == "1"
tree = {f"w{i}": np.full((256, 1024), i, np.float32) for i in range(24)}  # 24 MiB: a save lasts a while
print("ready", flush=True)
sys.stdin.readline()
eqxckpt.save(path, tree, overwrite=overwrite)
"""


def test_ctrl_c_early_in_a_save_leaves_nothing_behind(tmp_path, request):
    """SIGINT at moments from the very start of a save into its writes: the save stops, and
    neither a temporary directory nor a partial checkpoint is left; the old one is intact."""
    rng = random.Random(0)
    old = {"w0": np.zeros(4, np.float32)}
    for trial in range(40 if request.config.getoption("--slow") else 10):
        directory = tmp_path / str(trial)
        directory.mkdir()
        overwrite = trial % 2 == 1
        if overwrite:
            eqxckpt.save(directory / "ckpt", old)
        child = subprocess.Popen(
            [sys.executable, "-c", INTERRUPTED, str(directory / "ckpt"), "1" if overwrite else "0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )
        if child.stdout.readline().strip() != "ready":
            child.kill()
            raise AssertionError(f"the child did not start: {child.communicate()[1]}")
        child.stdin.write("go\n")
        child.stdin.flush()
        threading.Event().wait(rng.uniform(0.0, 0.08))  # from the first instant of the save on
        child.send_signal(signal.SIGINT)
        _, err = child.communicate(timeout=120)
        # Python ends on an uncaught KeyboardInterrupt by killing itself with SIGINT.
        assert child.returncode in (0, -signal.SIGINT) or "KeyboardInterrupt" in err, (child.returncode, err)
        names = sorted(os.listdir(directory))
        assert names == ["ckpt"] or (names == [] and not overwrite), names
        if "ckpt" in names:  # the old checkpoint untouched, or (interrupted while committing) the new one whole
            restored = eqxckpt.load(directory / "ckpt")
            if restored["w0"].shape == (4,):
                assert overwrite and child.returncode != 0
            else:
                assert_trees_equal(restored, {f"w{i}": np.full((256, 1024), i, np.float32) for i in range(24)})
            assert eqxckpt.verify(directory / "ckpt").ok
