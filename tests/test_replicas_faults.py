"""Faults in replica-parallel saves and read-once restores on S3 (moto) and Cloud Storage
(fake-gcs-server), with real JAX worker processes on 127.0.0.1."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import WORKERS, ObjectStore, start_workers

import eqxckpt

pytestmark = pytest.mark.multiprocess

WORKER = WORKERS / "replicas_fault_worker.py"


def run_workers(scenario, processes, directory, timeout=120, **env_vars):
    """Start the workers; wait until all exit (or ``timeout``); kill the rest.
    Returns (exit codes, RESULT dicts per worker, seconds, logs)."""
    directory.mkdir(parents=True, exist_ok=True)
    workers, logs = start_workers(WORKER, scenario, processes, directory, **env_vars)
    start = time.monotonic()
    try:
        while time.monotonic() - start < timeout and any(w.poll() is None for w in workers):
            time.sleep(0.1)
    finally:
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGKILL)
            w.wait()
    texts = [log.read_text() for log in logs]
    results = [[_parsed(line[7:]) for line in t.splitlines() if line.startswith("RESULT ")] for t in texts]
    return [w.returncode for w in workers], results, round(time.monotonic() - start, 1), texts


def _parsed(line: str) -> dict:
    # A dying worker's abort message may run into the line (stdout and stderr share the log).
    value, _ = json.JSONDecoder().raw_decode(line)
    return value


def _store(where, s3, gcs):
    return ObjectStore("s3", *s3) if where == "s3" else gcs


def _one(results, key):
    return {r["process"]: r for rs in results for r in rs if key in r}


def _check_run(spec: dict, processes: int, tmp_path, expect_step1: str | None) -> dict:
    """A fresh job on the run: it lists the steps, tries to save step 1 again, and checks
    every listed step bit for bit. Returns process 0's results."""
    codes, results, _, texts = run_workers(
        "resave", processes, tmp_path / "resave", timeout=120, ATTACK_STORE=json.dumps(spec)
    )
    assert codes == [0] * processes, texts
    found = {
        key: r[key] for r in results[0] for key in ("steps_before", "raised", "message", "steps", "checked") if key in r
    }
    for rs in results:
        checked = next(r["checked"] for r in rs if "checked" in r)
        assert checked["0"] == {"step0": 0}, checked  # step 0 exact in every process
        if "1" in checked and expect_step1 is not None:
            assert checked["1"][expect_step1] == 0, checked
    return found


# Each instant once: on S3 as it writes and once committed; on Cloud Storage (the same
# protocol, another server) as it enters the commit.
@pytest.mark.parametrize("where, at", [("s3", "write"), ("s3", "committed"), ("gcs", "commit")])
def test_process_0_killed_during_a_replica_parallel_save(tmp_path, where, at, s3, gcs):
    """Three processes save step 1 (a leaf replicated on all three, each writing a share,
    and one sharded); process 0 (the coordinator, the lease holder) is SIGKILLed as it
    writes, as it enters the commit, or just after the manifest's conditional write. The
    survivors die with it (JAX's coordination agent aborts them) or raise a CheckpointError;
    none may return "saved". Step 1 is then absent, or committed whole and exact; step 0
    loads bit-exact in every process of a fresh job, which saves step 1 again."""
    store = _store(where, s3, gcs)
    spec = store.spec(f"a9-lost0-{where}-{at}-{tmp_path.name}/run/")
    codes, results, _, texts = run_workers(
        "lost", 3, tmp_path, timeout=100, ATTACK_STORE=json.dumps(spec), ATTACK_VICTIM="0", ATTACK_AT=at,
        EQXCKPT_BARRIER_TIMEOUT_S="5",
    )  # fmt: skip
    assert codes[0] == -signal.SIGKILL, texts
    outcomes = _one(results, "after")
    assert not any(r.get("returned") == "saved" for r in outcomes.values()), outcomes
    # A survivor that outlives JAX's abort raises a CheckpointError (not JAX's own
    # JaxRuntimeError from the coordination service, as `Phases.run` once did).
    assert all(r["ours"] for r in outcomes.values()), outcomes
    steps = eqxckpt.CheckpointManager(spec).all_steps()
    assert steps == ([0, 1] if at == "committed" else [0]), steps
    # The fresh job saves step 1 again at once where it was not committed: the dead
    # holder's lease names a process that is gone from this machine.
    found = _check_run(spec, 3, tmp_path, expect_step1="step1" if at == "committed" else "step1b")
    assert found["steps"] == [0, 1], found
    assert ("raised" in found) == (at == "committed"), found


def test_a_resumed_job_can_save_the_step_its_dead_leader_was_saving(tmp_path, s3):
    """Process 0 of a 3-process job is SIGKILLed while it saves step 1 to S3 (it holds the
    step's lease). The job is restarted at once, resumes from step 0 and saves step 1
    again, as a scheduler's restart does: the lease names a holder that is provably dead
    on this machine, so the new save takes over at once (before, every process raised
    CheckpointBusyError until the 600 s lease timeout passed)."""
    store = ObjectStore("s3", *s3)
    spec = store.spec(f"a9-resume-{tmp_path.name}/run/")
    codes, _, _, texts = run_workers(
        "lost", 3, tmp_path, timeout=100, ATTACK_STORE=json.dumps(spec), ATTACK_VICTIM="0", ATTACK_AT="write",
        EQXCKPT_BARRIER_TIMEOUT_S="5",
    )  # fmt: skip
    assert codes[0] == -signal.SIGKILL, texts
    found = _check_run(spec, 3, tmp_path, expect_step1="step1b")
    assert "raised" not in found, found["message"]
    assert found["steps"] == [0, 1]


FAULT_MESSAGES = {
    "overwrite": ("CheckpointChangedError", "was replaced or deleted by another process while it was being read"),
    "garbage": ("CorruptCheckpointError", "Leaf 'r' is corrupt or missing on disk: chunk r/c/1/0 fails its CRC-32C"),
    "truncate": ("CorruptCheckpointError", "Leaf 'r' is corrupt or missing on disk: chunk file r/c/1/0 holds"),
    "delete": ("CorruptCheckpointError", "Leaf 'r' is corrupt or missing on disk: chunk file r/c/1/0 is missing"),
}


@pytest.mark.parametrize(
    "where, fault",
    [("s3", f) for f in FAULT_MESSAGES],  # the read path is the same on Cloud Storage
)
def test_a_fault_during_a_read_once_restore_is_raised_in_every_process(tmp_path, where, fault, s3, gcs):
    """Two processes restore a replicated leaf read once in all (each reads one of its two
    chunks); just before process 1's read, another job overwrites the checkpoint, or its
    chunk objects are rewritten with other bytes of the same size, cut one byte short, or
    deleted. Every process raises the same CheckpointError naming the leaf (process 0's
    own part was read intact), none returns values; a load afterwards returns the new
    checkpoint exact, or raises again for the damaged one."""
    store = _store(where, s3, gcs)
    codes, results, _, texts = run_workers(
        "replaced", 2, tmp_path, timeout=150, ATTACK_STORE=json.dumps(store.spec(f"a9-fault-{fault}-{tmp_path.name}/")),
        ATTACK_FAULT=fault, EQXCKPT_BARRIER_TIMEOUT_S="60",
    )  # fmt: skip
    assert codes == [0, 0], texts
    assert [r for r in results[1] if "fault_rc" in r][0]["fault_rc"] == 0, results[1]
    kind, text = FAULT_MESSAGES[fault]
    for rs in results:
        first = next(r for r in rs if "after" in r and "again" not in r)
        again = next(r for r in rs if "again" in r)
        assert first.get("raised") == kind and text in first["message"], first
        if fault == "overwrite":
            assert again.get("mismatched", {}).get("new") == 0, again
        else:
            assert again.get("raised") == "CorruptCheckpointError" and "Leaf 'r'" in again["message"], again


def test_read_once_restore_with_a_tiny_budget_is_exact(tmp_path, s3):
    """A 24 MiB leaf replicated on two processes, restored read-once from S3 with a 1 MiB
    host_memory_budget: exact in both. (Each process's peak grew by ~59 MiB for its
    24 MiB result, whatever the budget: the spread part and the chunk are held whole.)"""
    store = ObjectStore("s3", *s3)
    codes, results, _, texts = run_workers(
        "budget", 2, tmp_path, timeout=150, ATTACK_STORE=json.dumps(store.spec(f"a9-budget-{tmp_path.name}/")),
        ATTACK_BUDGET=str(1 << 20), EQXCKPT_BARRIER_TIMEOUT_S="60",
    )  # fmt: skip
    assert codes == [0, 0], texts
    found = _one(results, "mismatched")
    assert sorted(found) == [0, 1] and all(r["mismatched"] == 0 for r in found.values()), found
    print({p: r["after"]["VmHWM"] - r["base"]["VmRSS"] for p, r in found.items()})


def probe(spec, mib: int, budget: int, target: str) -> dict:
    done = subprocess.run(
        [sys.executable, str(WORKERS / "budget_probe.py"), json.dumps(spec), str(mib), str(budget), target],
        capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(done.stdout.split("PROBE ", 1)[1].splitlines()[0])


BUDGET = 4 << 20
SLACK_MIB = 16  # allocator and runtime noise: local-disk restores measure 6 MiB beyond the result


def test_a_local_restore_onto_one_device_holds_about_its_budget(tmp_path):
    found = probe(str(tmp_path / "ckpt"), 64, BUDGET, "device")
    assert found["exact"] and found["beyond_result_mib"] <= BUDGET / 2**20 + SLACK_MIB, found


@pytest.mark.parametrize("target", ["device", "numpy"])
def test_an_object_store_restore_holds_about_its_budget(tmp_path, target, s3):
    """A 64 MiB leaf (one 64 MiB chunk) restored from S3 with host_memory_budget=4 MiB:
    docs/safety.md promises at most the budget beyond the result. The chunk's ranged
    parts in flight are bounded by the budget (they held ~80 MiB, all 8 MiB parts at once
    whatever the budget, before); from a local disk, 6 MiB."""
    found = probe(ObjectStore("s3", *s3).spec(f"a9-probe-{target}-{tmp_path.name}/"), 64, BUDGET, target)
    assert found["exact"], found
    assert found["beyond_result_mib"] <= BUDGET / 2**20 + SLACK_MIB, found


def test_a_restore_split_by_columns_holds_about_its_budget(tmp_path):
    """A 64 MiB leaf of 1 KiB rows split by columns over two devices, from a local disk,
    host_memory_budget=4 MiB: its one chunk is 65536 rows x 2 blocks, too many runs to
    read straight into the devices' buffers, so it is read a slab of rows at a time
    (`_chunk_reads.read_slabs`), not through a buffer of the whole chunk (~70 MiB beyond the
    result before)."""
    found = probe(str(tmp_path / "ckpt"), 64, BUDGET, "cols2")
    assert found["exact"], found
    assert found["beyond_result_mib"] <= BUDGET / 2**20 + SLACK_MIB, found


@pytest.mark.parametrize("mib", [64, 128])
def test_a_restore_of_wide_rows_split_on_a_grid_holds_about_its_budget(tmp_path, mib):
    """Two rows of 32 (64) MiB each split both ways over a 2x2 mesh, host_memory_budget=4
    MiB (the outside attack on the slab reader): a 64 MiB leaf is one chunk of both rows,
    read a part of a row at a time (a slab was a whole row: 38 MiB beyond the result); a
    128 MiB leaf's chunks go straight in, and its digest hashes a part of a row at a time
    (its band buffer held a whole row: 70 MiB)."""
    found = probe(str(tmp_path / "ckpt"), mib, BUDGET, "grid4")
    assert found["exact"], found
    assert found["beyond_result_mib"] <= BUDGET / 2**20 + SLACK_MIB, found


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_leaf_whose_replicas_differ_is_not_saved_as_a_mix(tmp_path, where, s3):
    """Two processes save a leaf sharded P() whose replicas differ (process k's holds the
    values + k). Each writes half of its chunks from its own copy, so the checkpoint would
    hold rows 0-767 from process 0 and 768-1535 from process 1, with process 0's digest:
    every process refuses the save before the commit, naming the leaf and the processes,
    and nothing is committed."""
    extra = {}
    if where == "s3":
        store = ObjectStore("s3", *s3)
        prefix = f"a9-div-{tmp_path.name}/"
        extra["ATTACK_STORE"] = json.dumps(store.spec(prefix))
        location = store.spec(prefix + "div/")
    else:
        location = str(tmp_path / "div")
    codes, results, _, texts = run_workers("divergent", 2, tmp_path, timeout=100, **extra)
    assert codes == [0, 0], texts
    saved = _one(results, "after")
    for process, outcome in saved.items():
        assert outcome.get("raised") == "UnsupportedLeafError", (process, outcome)
        assert (
            "The replicas of 1 leaf differ between processes: 'r' (part [0:1536,0:256]: processes 0 and 1)"
            in (outcome["message"])
        ), outcome
    with pytest.raises(eqxckpt.CheckpointNotFoundError):
        eqxckpt.load(location)


def test_a_small_replicated_leaf_that_differs_is_refused_or_consistent(tmp_path):
    """Leaf "b" (64 bytes, P() on two processes) is 1.0 on process 0 and 2.0 on process 1.
    Too small to split, it is written whole by process 1 (the fewest bytes so far), while
    process 0 digests its own copy. Either the save is refused (as for a large leaf), or
    what is committed must agree with its own digest. (Before, a writer of a whole part
    published no digest of its copy, and it committed with process 0's digest.)"""
    codes, results, _, texts = run_workers("small_differ", 2, tmp_path, timeout=100)
    assert codes == [0, 0], texts
    outcomes = _one(results, "saved")
    if not outcomes[0]["saved"]:
        assert outcomes[0]["raised"] == "UnsupportedLeafError", outcomes
        assert "'b'" in outcomes[0]["message"], outcomes
        return
    restored = eqxckpt.load(str(tmp_path / "ckpt"))
    assert np.asarray(restored["a"]).tolist() == list(range(16))
    report = eqxckpt.verify(str(tmp_path / "ckpt"))
    assert not report.problems, (np.asarray(restored["b"]).tolist(), report.problems)


@pytest.mark.parametrize("where", ["s3"])  # Cloud Storage: test_distributed's replicated_data...[gcs]
def test_awkward_replicated_leaves_round_trip_across_three_processes(tmp_path, where, s3, gcs):
    """Three processes (an odd count) save replicated leaves of awkward shapes and dtypes
    (rows not divisible by 3, bfloat16, int8, a 2x2 leaf), each writing a share, and
    restore them replicated and by rows: every element bit-exact in every process, and
    whole in a single process afterwards."""
    from attack_worker import values

    store = _store(where, s3, gcs)
    prefix = f"a9-odd-{tmp_path.name}/"
    codes, results, _, texts = run_workers(
        "odd", 3, tmp_path, timeout=150, ATTACK_STORE=json.dumps(store.spec(prefix)), EQXCKPT_BARRIER_TIMEOUT_S="60"
    )
    assert codes == [0, 0, 0], texts
    found = _one(results, "odd_bad")
    assert sorted(found) == [0, 1, 2] and not any(r["odd_bad"] for r in found.values()), found
    import ml_dtypes

    restored = eqxckpt.load(store.spec(prefix + "odd/"))
    for k, (shape, d) in {"a": ((1001, 257), np.float32), "b": ((3, 50000), ml_dtypes.bfloat16)}.items():
        assert np.asarray(restored[k]).tobytes() == values(f"odd/{k}", shape, np.dtype(d)).tobytes(), k
    assert not eqxckpt.verify(store.spec(prefix + "odd/")).problems
