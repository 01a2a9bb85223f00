"""The local tier (`eqxckpt._local`) in real multi-process JAX jobs on 127.0.0.1: four
processes whose local tiers are wiped, killed mid-save, stale, shared, deleted or sent
damaged parts, resuming from peers, from an object store, or refusing together."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
from conftest import WORKERS, launch, manifest_doc, start_workers
from test_local import _own_steps

import eqxckpt
from eqxckpt._local import LocalTier
from eqxckpt._storage import resolve

WORKER = WORKERS / "local_tier_worker.py"


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


def _resumed(logs: list[str]) -> list[tuple[str, int]]:
    """Each process's ``RESUMED <step> <elements checked>``."""
    out = []
    for log in logs:
        [line] = [line for line in log.splitlines() if line.startswith("RESUMED")]
        _, step, checked = line.split()
        out.append((step, int(checked)))
    return out


def _train(tmp_path: pathlib.Path, until: int, processes: int = 4, **env: str) -> list[tuple[str, int]]:
    return _resumed(launch("train", processes, tmp_path, worker=WORKER, LOCAL_UNTIL=str(until), **env))


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


@pytest.mark.multiprocess
def test_a_job_never_resumes_a_deleted_or_replaced_run_nor_onto_another_mesh(tmp_path):
    # Two processes (each claim here is about one process's part and its peer's copy; the
    # four-process jobs above and below cover the placement of copies among more).
    n = 2
    # Run 0 reaches step 6 (persistent steps 0 and 4), each process's local tier on its own host.
    _train(tmp_path, 7, n)
    # Each part is an ordinary checkpoint of the tree's own leaves: a sharded leaf records the
    # one block of it that process 1 holds (4 of 8 rows), a replicated one is whole.
    [manifest] = (tmp_path / "host1").glob("eqxckpt-local/*/process-1/own/6/eqxckpt.json")
    leaves = {leaf["path"]: leaf for leaf in manifest_doc(manifest.read_text())["leaves"]}
    assert leaves["params/w"]["blocks"] == [[[4, 8], [0, 1024]]] and leaves["keys"]["blocks"] == [[[1, 2], [0, 2]]]
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
    resumed = _train(tmp_path, 7, n)
    assert [step for step, _ in resumed] == ["6"] * n and all(checked > 0 for _, checked in resumed)
    # Process 0's own part loses its manifest (its peer keeps a sound copy): set aside, not
    # deleted, and the copy restored in its place (the second outside attack: load raised).
    [lost] = (tmp_path / "host0").glob("eqxckpt-local/*/process-0/own/6/eqxckpt.json")
    lost.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = _train(tmp_path, 7, n)
    assert [step for step, _ in resumed] == ["6"] * n and all(checked > 0 for _, checked in resumed)
    assert list(lost.parent.parent.glob(".6.set-aside-*")) and lost.exists()
    # The job resumes from the persistent step 4 and saves steps 5 and 6 again (seed 3) while
    # host 1 is away; host 1 then comes back with its tier of the first steps 5 and 6. Both
    # saves of step 6 are complete: the newer one is restored, never the one it replaced.
    away = tmp_path / "away-host1"
    shutil.move(tmp_path / "host1", away)
    _train(tmp_path, 7, n, LOCAL_FROM="4", LOCAL_FROM_SEED="0", LOCAL_SEED="3")
    shutil.rmtree(tmp_path / "host1")
    shutil.move(away, tmp_path / "host1")
    resumed = _train(tmp_path, 7, n, LOCAL_SEED="3")
    assert [step for step, _ in resumed] == ["6"] * n and all(checked > 0 for _, checked in resumed)
    # Restored onto another mesh (every leaf replicated): each process holds only its own
    # blocks, so every process refuses, naming the sharded leaves, before reading anything.
    logs = launch("train", n, tmp_path, worker=WORKER, LOCAL_UNTIL="7", LOCAL_LIKE="replicated")
    refused = [line for log in logs for line in log.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == n and all("params/w" in line and "holds only blocks" in line for line in refused)
    # The run is deleted and started afresh (seed 1): no process resumes the deleted run's step 6.
    shutil.rmtree(tmp_path / "run")
    assert _train(tmp_path, 3, n, LOCAL_SEED="1") == [("None", 0)] * n
    # A new run at the same path reaches step 6 too: the local step 6 is the new run's, bit-exact.
    resumed = _train(tmp_path, 7, n, LOCAL_SEED="1")
    assert [step for step, _ in resumed] == ["2"] * n and all(checked > 0 for _, checked in resumed)
    # A host comes back with the old run's tier (run 0's parts of step 6): never mixed in.
    old = tmp_path / "old-host1"
    shutil.copytree(tmp_path / "host1", old)
    shutil.rmtree(tmp_path / "run")
    _train(tmp_path, 5, n, LOCAL_SEED="2")  # run 2 reaches step 4
    shutil.rmtree(tmp_path / "host1")
    shutil.copytree(old, tmp_path / "host1")
    resumed = _train(tmp_path, 6, n, LOCAL_SEED="2")
    assert [step for step, _ in resumed] == ["4"] * n and all(checked > 0 for _, checked in resumed)


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
