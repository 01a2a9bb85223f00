"""Real multi-process JAX: worker subprocesses on 127.0.0.1, 2 CPU devices each."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from attack_worker import values as attack_values  # pyright: ignore[reportMissingImports]
from conftest import BUCKET, WORKERS, WorkerFailed, assert_trees_equal, launch, s3_spec
from distributed_worker import global_state

import eqxckpt
from eqxckpt._storage._stamps import BOOK_NAME

pytestmark = pytest.mark.multiprocess  # every test here starts worker processes

WORKER = WORKERS / "distributed_worker.py"


@pytest.mark.parametrize("processes", [2, 4])
def test_many_processes_save_and_restore_onto_another_mesh(tmp_path, processes, s3, gcs):
    # Workers save (blocking and async, to disk, to S3 and to GCS), restore onto a
    # different mesh and check every slice they hold...
    endpoint, _ = s3
    logs = launch("save", processes, tmp_path, S3_TEST_ENDPOINT=endpoint, S3_TEST_BUCKET=BUCKET, GCS_TEST_BUCKET=BUCKET)
    assert all(f"{name} restored" in log for log in logs for name in ("blocking", "async", "s3", "gcs"))
    # ...then a fresh single process, with one device, reads everything back whole.
    verify = f"""
import eqxckpt
from distributed_worker import check
for where in ({str(tmp_path / "blocking")!r}, {str(tmp_path / "async")!r}):
    assert check(eqxckpt.load(where)) > 0
assert eqxckpt.open({str(tmp_path / "async")!r})["step"] == 7
print("verified")
"""
    result = subprocess.run(
        [sys.executable, "-c", verify],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=WORKER.parent,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert result.returncode == 0 and "verified" in result.stdout, result.stderr
    assert sorted(os.listdir(tmp_path)) == ["async", "blocking"] + [f"save{i}.log" for i in range(processes)]
    if processes == 4:  # elastic: what 4 processes wrote, on disk, S3 and GCS, restored by 1 and by 8
        sources = [
            str(tmp_path / "blocking"),
            s3_spec(endpoint, f"mp{processes}/"),
            {"driver": "gcs", "bucket": BUCKET, "path": f"mp{processes}/"},
        ]
        # Fewer readers than writers, and more (the state's shapes divide by 8, not by 6).
        for readers in (1, 8):
            directory = tmp_path / f"readers{readers}"
            directory.mkdir()
            logs = launch("load", readers, directory, timeout=360, ELASTIC_SOURCES=json.dumps(sources))
            assert all(f"source {i} restored" in log for log in logs for i in range(len(sources))), logs


def test_chunks_follow_the_writers_shards(tmp_path):
    launch("save", 2, tmp_path)

    zarr = json.loads((tmp_path / "async" / "model" / "layers" / "0" / "weight" / "zarr.json").read_text())
    # (16, 8) sharded ("data", "model") over a (2, 2) mesh: one chunk per (8, 4) shard.
    assert zarr["chunk_grid"]["configuration"]["chunk_shape"] == [8, 4]


def test_a_single_process_checkpoint_restores_across_four_processes(tmp_path, s3, gcs):
    endpoint, _ = s3
    sources = [str(tmp_path / "single"), s3_spec(endpoint, "single/"), gcs.spec("single/")]
    for where in sources:
        eqxckpt.save(where, global_state(None))
    logs = launch("load", 4, tmp_path, ELASTIC_SOURCES=json.dumps(sources))
    assert all(f"source {i} restored" in log for log in logs for i in range(len(sources)))


def test_checkpoint_manager_in_two_processes(tmp_path):
    logs = launch("manager", 2, tmp_path)
    assert all("manager steps [0, 3, 5, 6]" in log for log in logs)
    assert sorted(os.listdir(tmp_path / "run")) == [BOOK_NAME, "0", "3", "5", "6"]  # and its stamp book
    assert eqxckpt.CheckpointManager(tmp_path / "run").all_steps() == [0, 3, 5, 6]


def test_a_crashed_worker_fails_the_launch_within_seconds(tmp_path):
    start = time.monotonic()
    with pytest.raises(WorkerFailed, match="worker 1 crashed on purpose"):
        launch("crash", 2, tmp_path)
    assert time.monotonic() - start < 30


def test_sigterm_to_one_process_saves_the_same_step_on_every_process(tmp_path):
    """JAX's preemption service takes the notice to every process; each saves the same
    step and exits cleanly, and the rerun resumes and ends as an unstopped run does."""
    logs = launch("preempt", 2, tmp_path, terminate=(1, "process 1: step 3"))
    assert not any("done" in log for log in logs)
    steps = eqxckpt.CheckpointManager(tmp_path / "run").all_steps()
    stopped = steps[-1]
    assert steps[0] == 0 and stopped >= 3, steps
    assert all(f": step {stopped}\n" not in log and "preemption notice" in log for log in logs)  # saved, exited
    logs = launch("preempt", 2, tmp_path)
    assert all(f"resumed from {stopped}" in log and "done" in log for log in logs)
    reference = tmp_path / "reference"
    reference.mkdir()
    launch("preempt", 2, reference)
    for step in (10, 20):
        assert_trees_equal(eqxckpt.load(tmp_path / "run" / str(step)), eqxckpt.load(reference / "run" / str(step)))


def test_stack_and_unstack_across_processes_read_each_chunk_in_one_process(tmp_path, monkeypatch):
    """Two processes of 2 devices: a skeleton stacked along the layers (a layer a device),
    and per-layer leaves split by rows. Every value checked in every process; each chunk
    file is read by the one process whose devices hold its elements, and by no other."""
    from distributed_worker import LAYERS, layer_values

    import eqxckpt._chunks as chunks_module

    monkeypatch.setattr(chunks_module, "CHUNK_BYTES", 64)  # a chunk per 16 floats: a row
    layers = [layer_values(i) for i in range(LAYERS)]
    eqxckpt.save(tmp_path / "per_layer", {"blocks": [{"w": x} for x in layers]})
    eqxckpt.save(tmp_path / "stacked", {"blocks": {"w": np.stack(layers)}})
    logs = launch("layout", 2, tmp_path)
    for kind, every in (("stack", LAYERS * 8), ("unstack", LAYERS * 8)):
        reads = [json.loads(log.split(f": {kind} read ", 1)[1].splitlines()[0]) for log in logs]
        assert not set(reads[0]) & set(reads[1]), (kind, reads)  # no chunk read by both
        assert all(len(r) == len(set(r)) == every // 2 for r in reads), (kind, reads)  # each once, half each


@pytest.mark.parametrize("where", ["local", "s3", "gcs"])
def test_replicated_data_is_written_and_read_once_in_all(tmp_path, where, s3, gcs):
    """Four processes of one device each save 8 MiB replicated on all of them (a large leaf,
    smaller ones, PRNG keys) and 8 MiB sharded across them, and restore it onto the same
    mesh, swapped (replicated leaves sharded and the other way), and onto a 2x2 mesh
    replicated over a process-spanning axis; every value checked bit for bit. Bytes counted
    per process: ``/proc/self/io`` on a local disk, TensorStore's kvstore counters on S3
    and GCS."""
    from replica_worker import leaves

    endpoint, _ = s3
    logs = launch(
        where,
        4,
        tmp_path,
        worker=WORKERS / "replica_worker.py",
        S3_TEST_ENDPOINT=endpoint,
        S3_TEST_BUCKET=BUCKET,
        GCS_TEST_BUCKET=BUCKET,
        REPLICA_PREFIX=f"replicas-{tmp_path.name}/",
    )
    reports = [json.loads(log.split("REPORT ", 1)[1].splitlines()[0]) for log in logs]
    shapes = leaves(8, 8, 4)
    state = sum(int(np.prod(shape)) * (8 if kind == "k" else 4) for shape, kind in shapes.values())
    assert all(r["checked"] > 0 for r in reports)
    written = [r["save"]["written"] for r in reports]
    assert sum(written) <= 1.2 * state and max(written) <= 1.5 * sum(written) / 4, written
    for restore in ("load", "load_square"):  # the same mesh, and a 2x2 mesh
        read = [r[restore]["read"] for r in reports]
        assert sum(read) <= 1.3 * state, (restore, read)
    if where == "local":  # chunk files alone: each chunk read in one process
        assert sum(r["load"]["chunk_read"] for r in reports) <= 1.05 * state


ATTACKER = WORKERS / "attack_worker.py"


def _results(logs: list[str]) -> list[list[dict]]:
    return [
        [json.loads(line[len("RESULT ") :]) for line in log.splitlines() if line.startswith("RESULT ")] for log in logs
    ]


def test_a_read_failing_in_one_process_never_returns_a_mix(tmp_path):
    """The newest checkpoint has a damaged chunk only process 1 reads (of a leaf sharded
    across processes); its load raises there and it falls back to the older checkpoint.
    Every process must either raise, or return the checkpoint it asked for: never a
    replicated leaf half from one checkpoint and half from the other."""
    logs = launch("one_failed_read_then_fallback", 2, tmp_path, worker=ATTACKER)
    returned = [r for rs in _results(logs) for r in rs if "returned" in r]
    assert len(returned) == 2, logs
    assert all(not any(r["mismatched"].values()) for r in returned), returned


@pytest.mark.parametrize(
    "devices, env",
    [
        # Process 0 holds two of the mesh's three devices, process 1 one: the same budget
        # makes four batches on process 0 and two on process 1.
        (2, {"ATTACK_MESH": "uneven", "ATTACK_SAVE_SPEC": "p", "ATTACK_BUDGETS": "600000,600000"}),
        # Each host passes the budget it can afford (as from its own free memory).
        (1, {"ATTACK_BUDGETS": "300000,100000000"}),
    ],
    ids=["uneven-mesh", "budgets-differ"],
)
def test_batches_of_a_replicated_restore_are_the_same_in_every_process(tmp_path, devices, env):
    """Four replicated leaves restored in batches of the host memory budget: the batches
    (each a phase and a collective) must be the same in every process, or the processes
    wait for each other forever."""
    logs = launch("batches", 2, tmp_path, timeout=40, worker=ATTACKER, ATTACK_DEVICES=str(devices), **env)
    restored = [r for rs in _results(logs) for r in rs if "failures" in r]
    assert len(restored) == 2 and not any(r["failures"] for r in restored), logs


def test_a_checkpoint_replaced_during_a_load_is_never_returned_mixed(tmp_path):
    """Another job replaces the checkpoint (``overwrite=True``, the same chunking) while two
    processes load it, replicated: process 0 has read its part of the old one when process
    1 opens the new one. Process 0 notices and raises; process 1 must raise too, or return
    one checkpoint whole, never half of each."""
    logs = launch("replaced_during_load", 2, tmp_path, timeout=100, worker=ATTACKER)
    returned = [r["returned"] for rs in _results(logs) for r in rs if "returned" in r]
    assert all(min(r.values()) == 0 for r in returned), returned


def test_processes_that_disagree_on_a_load_raise_rather_than_mix(tmp_path):
    """Processes loading together with different dtypes or meshes for a leaf replicated
    across them (which one jitted identity moves between them), or from two checkpoints
    into a leaf sharded across them (one global array of both): every process raises a
    CheckpointError naming the leaf or the checkpoints, none returns another's values."""
    logs = launch("disagree", 2, tmp_path, timeout=60, worker=ATTACKER)
    found = {(r["case"], r["process"]): r for rs in _results(logs) for r in rs if "case" in r}
    for case, raised, named in [
        ("dtype", "ArgumentError", "Leaf 'r': process 0 expects float32[512,256]"),
        ("mesh", "ArgumentError", "process 1 gave 'r' as float32[512,256]"),
        ("steps", "CheckpointChangedError", f"process 0: {tmp_path}/a; process 1: {tmp_path}/b"),
    ]:
        for process in (0, 1):
            assert found[case, process].get("raised") == raised, found[case, process]
            assert named in found[case, process]["message"], found[case, process]
    assert found["same", 0]["mismatched"] == found["same", 1]["mismatched"] == 0, found


def test_a_load_failing_in_one_process_as_it_opens_fails_in_every_process(tmp_path):
    """Each process loads its own host's copy of a checkpoint, replicated; process 1's has a
    damaged manifest, so its load fails before any read. Process 0 must raise too (not wait
    for it, nor pair its load with process 1's next one); then both load a good checkpoint."""
    logs = launch("one_sided_failure", 2, tmp_path, timeout=60, worker=ATTACKER, EQXCKPT_BARRIER_TIMEOUT_S="10")
    found = {(r["attempt"], r["process"]): r for rs in _results(logs) for r in rs if "attempt" in r}
    for process in (0, 1):
        assert found[0, process].get("raised") == "ManifestError", found
        assert "host1 is not valid JSON" in found[0, process]["message"], found
        assert found[1, process].get("mismatched") == 0, found
    assert "Process 1 failed during the 'plan' phase" in found[0, 0]["message"], found


@pytest.mark.parametrize(
    "at, how, victim",
    [
        ("write", "KILL", 2),  # killed while writing its share of a replicated leaf
        ("commit", "SLOW", 0),  # process 0 commits after the others gave up waiting
    ],
)
def test_a_process_lost_during_a_save_fails_it_everywhere_and_leaves_the_last_step_whole(tmp_path, at, how, victim):
    """Four processes save step 1 of a run (step 0 committed): a leaf replicated on all of
    them (each writes a share) and one sharded across them. One process is killed as it
    writes, or process 0 is held up as it commits until the others stop waiting. Every
    other process raises a CheckpointError within the barrier timeout saying truly what
    was left; step 1 is either absent or whole, and step 0 still loads bit-exact."""
    from attack_worker import values

    logs = launch(
        "signalled", 4, tmp_path, timeout=90, worker=ATTACKER, dies=victim,
        EQXCKPT_BARRIER_TIMEOUT_S="3", ATTACK_VICTIM=str(victim), ATTACK_AT=at, ATTACK_SIGNAL=how, ATTACK_SLOW_S="6",
    )  # fmt: skip
    found = {r["process"]: r for rs in _results(logs) for r in rs if "after" in r}
    assert sorted(found) == [p for p in range(4) if how == "SLOW" or p != victim], logs
    assert all(r.get("raised") == "CheckpointError" for r in found.values()), found
    manager = eqxckpt.CheckpointManager(tmp_path / "run")  # (removes what the save left)
    assert sorted(os.listdir(tmp_path / "run")) == [str(s) for s in manager.all_steps()]
    for step in manager.all_steps():
        assert not eqxckpt.verify(manager.path(step)).problems  # the replicated leaf's digest included
        restored = manager.load(step=step)
        for k in ("r", "s"):
            assert np.asarray(restored[k]).tobytes() == values(f"step{step}/{k}", (1024, 256), np.float32).tobytes()
    if at == "write":
        assert manager.all_steps() == [0]
        assert all("Nothing was committed" in r["message"] for r in found.values()), found
    else:  # process 0 committed step 1, complete, after the others gave up: no process may deny it
        assert manager.all_steps() == [0, 1]
        assert not any("Nothing was committed" in r["message"] for r in found.values()), found
        assert "This process committed" in found[0]["message"], found
        assert all("Process 0 may have committed" in found[p]["message"] for p in (1, 2, 3)), found


def test_a_manager_load_failing_in_one_process_as_it_opens_fails_in_every_process(tmp_path):
    """As above, through each host's CheckpointManager: process 1's latest step is damaged
    after the managers listed it, so its `CheckpointManager.load` fails as it opens the
    step, before `load`. Process 0 must raise too at once (not wait the barrier timeout for
    it, nor pair its load with process 1's next one); then both load the good copy."""
    logs = launch("manager_one_sided", 2, tmp_path, timeout=60, worker=ATTACKER, EQXCKPT_BARRIER_TIMEOUT_S="20")
    found = {(r["attempt"], r["process"]): r for rs in _results(logs) for r in rs if "attempt" in r}
    for process in (0, 1):
        assert found[0, process].get("raised") == "ManifestError", found
        assert "is not valid JSON" in found[0, process]["message"], found
        assert found[0, process]["after"] < 15, found  # not the barrier timeout
        assert found[1, process].get("mismatched") == 0, found
    assert "Process 1 failed during the 'plan' phase" in found[0, 0]["message"], found


@pytest.mark.parametrize("where, at", [("s3", "write"), ("gcs", "read")])
def test_a_process_lost_on_an_object_store_leaves_the_last_step_whole(tmp_path, where, at, s3, gcs):
    """As above, on S3 and Cloud Storage: process 2 is killed as it writes its share of
    step 1 (replicated: each process writes a share), or as it reads its part of step 0
    (replicated: read once in all). The others raise a CheckpointError naming the phase
    within the barrier timeout; a lost save leaves nothing under step 1 (process 0 removed
    its prefix and lease), and step 0 still loads bit-exact."""
    from attack_worker import values
    from conftest import ObjectStore

    store = ObjectStore("s3", *s3) if where == "s3" else gcs
    prefix = f"lost-{where}-{at}-{tmp_path.name}/run/"
    logs = launch(
        "signalled", 4, tmp_path, timeout=90, worker=ATTACKER, dies=2, EQXCKPT_BARRIER_TIMEOUT_S="3",
        ATTACK_VICTIM="2", ATTACK_AT=at, ATTACK_SIGNAL="KILL", ATTACK_STORE=json.dumps(store.spec(prefix)),
    )  # fmt: skip
    found = {r["process"]: r for rs in _results(logs) for r in rs if "after" in r}
    assert sorted(found) == [0, 1, 3], logs
    for r in found.values():
        assert r.get("raised") == "CheckpointError" and r["after"] < 30, found
        phase = "'write' phase" if at == "write" else "'read 0' phase"
        assert f"not every process reached the {phase}" in r["message"], found
        assert at == "read" or "Nothing was committed" in r["message"], found
    assert not [key for key in store.keys(prefix) if not key.startswith(f"{prefix}0/")]
    manager = eqxckpt.CheckpointManager(store.spec(prefix))
    assert manager.all_steps() == [0]
    assert not eqxckpt.verify(manager.path(0)).problems
    restored = manager.load(step=0)
    for k in ("r", "s"):
        assert np.asarray(restored[k]).tobytes() == values(f"step0/{k}", (1024, 256), np.float32).tobytes()


def test_leaves_on_one_process_devices_save_and_load_together(tmp_path):
    """Leaves placed on one process's devices only (a pipeline stage's, or one remote
    device's) are global arrays: held by one process, seen as fully addressable there and
    as held elsewhere by the others. Every process must agree who writes them (their
    holder) and restore them together; a host-local leaf (each process's own) is still
    process 0's. A leaf replicated over both processes is read once into pinned host
    memory (#52)."""
    logs = launch("one_process_leaves", 2, tmp_path, timeout=120, worker=ATTACKER, ATTACK_DEVICES="2")
    results = _results(logs)
    for found in results:
        assert {"saved": True} in found, found
        loads = [r for r in found if "loaded" in r]
        assert [r["loaded"] for r in loads] == [None, "on0", "on1"], found
        assert all("error" not in r and not any(r["wrong"].values()) for r in loads), found
        assert {"pinned": ["pinned_host"], "wrong": 0} in found, found  # read once, into host memory
    restored = eqxckpt.load(tmp_path / "c")  # one process, no mesh: every leaf whole
    for name in ("on0", "on1", "single0", "single1", "everywhere"):
        np.testing.assert_array_equal(restored[name], attack_values(name, (8, 4), "float32"))
    np.testing.assert_array_equal(restored["local"], np.zeros(3, np.float32))
