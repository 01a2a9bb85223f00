"""`save_safetensors` from every process of a 4-process JAX job on 127.0.0.1: a sharded
HuggingFace directory on a local disk, S3 (moto) and GCS (fake-gcs-server), each file
byte for byte what `safetensors` writes, the index what `huggingface_hub` splits; each
process sent only what it lacks; a process killed at a random instant leaves no index."""

import json
import random

import numpy as np
import pytest
import safetensors.numpy as stn
from conftest import BUCKET, WORKERS, WorkerFailed, launch, s3_spec
from huggingface_hub import split_state_dict_into_shards_factory

import eqxckpt
from eqxckpt._formats._safetensors import INDEX_NAME
from eqxckpt._storage import resolve

pytestmark = pytest.mark.slow
PUBLISHER = WORKERS / "publish_worker.py"
MIB = 2.0


PT = {"format": "pt"}  # what the workers pass


def expected_files(tensors: dict, limit: int, metadata: dict | None = PT):
    plan = split_state_dict_into_shards_factory(
        tensors, get_storage_size=lambda t: t.nbytes, filename_pattern="model{suffix}.safetensors", max_shard_size=limit
    )
    files = {
        name: stn.save({n: tensors[n] for n in names}, metadata=metadata)
        for name, names in plan.filename_to_tensors.items()
    }
    index = {"metadata": {**plan.metadata, **(metadata or {})}, "weight_map": plan.tensor_to_filename}
    return files, index


def reports(logs):
    return [json.loads(log.split("REPORT ", 1)[1].splitlines()[0]) for log in logs]


@pytest.mark.parametrize("where", ["local", "s3", "gcs"])
def test_four_processes_write_the_librarys_files_and_the_hubs_index(tmp_path, where, s3, gcs):
    from publish_worker import expected_tensors, shard_limit

    endpoint, _ = s3
    prefix = f"published-{tmp_path.name}/"
    logs = launch(
        where, 4, tmp_path, worker=PUBLISHER, S3_TEST_ENDPOINT=endpoint, S3_TEST_BUCKET=BUCKET,
        GCS_TEST_BUCKET=BUCKET, PUBLISH_PREFIX=prefix,
    )  # fmt: skip
    tensors = expected_tensors(MIB, 4)
    files, index = expected_files(tensors, shard_limit(MIB))
    assert len(files) >= 4  # every process writes one or more
    storage = resolve(
        tmp_path / "out" if where == "local" else s3_spec(endpoint, prefix) if where == "s3"
        else {"driver": "gcs", "bucket": BUCKET, "path": prefix}
    )  # fmt: skip
    for name, raw in files.items():
        assert storage.read_small(name, 1 << 30) == raw, name
    assert json.loads(storage.read_small(INDEX_NAME, 1 << 20) or b"") == index
    # Each process was sent exactly the bytes of its files it did not hold, and some were.
    found = reports(logs)
    assert all(r["received"] == r["lacking"] for r in found), found
    assert sum(r["received"] for r in found) > 0
    if where == "local":  # read back by the library and by eqxckpt, bit for bit
        loaded = {}
        for name in files:
            loaded.update(stn.load_file(str(tmp_path / "out" / name)))
        ours = eqxckpt.open(tmp_path / "out")
        for name, value in tensors.items():
            for got in (loaded[name], ours[name.replace(".", "/")].get()):
                assert got.dtype == value.dtype and got.shape == value.shape and got.tobytes() == value.tobytes(), name


def test_four_processes_write_one_file_from_process_0(tmp_path):
    """Without max_shard_size: one file, written by process 0, sent what it lacks."""
    from publish_worker import expected_tensors

    logs = launch("local", 4, tmp_path, worker=PUBLISHER, PUBLISH_SINGLE="1")
    tensors = expected_tensors(MIB, 4)
    assert (tmp_path / "out.safetensors").read_bytes() == stn.save(tensors, metadata={"format": "pt"})
    found = reports(logs)
    assert found[0]["received"] == found[0]["lacking"] > 0
    assert all(r["received"] == r["lacking"] == 0 for r in found[1:])


@pytest.mark.parametrize("moment", ["random", "file"])
def test_a_process_killed_at_a_random_instant_leaves_no_index_and_a_rerun_completes(tmp_path, moment):
    """``random``: a random process at a random instant of the write (about 0.1-0.2 s);
    ``file``: a random process once it has written its first file, the others' files
    then left without an index."""
    rng = random.Random()
    victim = rng.randrange(4)
    delay = "file" if moment == "file" else f"{rng.uniform(0.0, 0.2):.3f}"
    out = tmp_path / "out"
    try:
        launch(
            "local", 4, tmp_path, worker=PUBLISHER, dies=victim, timeout=120, EQXCKPT_BARRIER_TIMEOUT_S="5",
            PUBLISH_MIB="8", PUBLISH_KILL=f"{victim}:{delay}",
        )  # fmt: skip
    except WorkerFailed:
        pass  # the others fail once the victim is gone, as they must
    from publish_worker import expected_tensors, shard_limit

    files, index = expected_files(expected_tensors(8, 4), shard_limit(8))
    present = sorted(p.name for p in out.iterdir()) if out.exists() else []
    if moment == "file":
        assert INDEX_NAME not in present and len([p for p in present if not p.startswith(".")]) >= 1, present
    if INDEX_NAME in present:  # it finished before the kill: complete, then
        assert json.loads((out / INDEX_NAME).read_text()) == index
    for name in present:
        if not name.startswith(".") and name != INDEX_NAME:  # nothing under a final name incomplete
            assert (out / name).read_bytes() == files[name], name
    (tmp_path / "again").mkdir()
    launch(
        "local", 4, tmp_path / "again", worker=PUBLISHER, PUBLISH_MIB="8", PUBLISH_OUT=str(out), PUBLISH_OVERWRITE="1"
    )
    for name, raw in files.items():
        assert (out / name).read_bytes() == raw
    assert json.loads((out / INDEX_NAME).read_text()) == index
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temporary left


DISAGREE = WORKERS / "publish_disagree_worker.py"
# Each scenario: the processes' calls that must raise (by index of call), and what is
# left in out/ (None: nothing there; "model": the first model, whole and committed).
DISAGREEMENTS = {
    "metadata_differs": ([0], None),
    "path_differs": ([0], None),
    "overwrite_differs": ([0], "model"),
    "one_bad_argument_then_agreement": ([0], None),
    "extra_leaf": ([0], None),
    "numpy_in_one": ([0], None),
    "bad_name_after_a_model": ([0], "model"),
}


def test_processes_that_ask_for_different_models_all_raise_and_write_nothing(tmp_path):
    """Found by an outside attack: processes that disagree on the path, the metadata,
    overwrite or the tree (or where one process's argument is refused) all raise at
    once (by the others' verdict in the first phases, never by waiting out a barrier),
    nothing is written, and a model already there stays committed; agreeing calls after
    a refused one pair up and write one model. Every scenario in turn, in one job."""
    logs = launch("all", 2, tmp_path, worker=DISAGREE, timeout=120, EQXCKPT_BARRIER_TIMEOUT_S="30")
    for scenario, (raising, left) in DISAGREEMENTS.items():
        for log in logs:
            calls = [json.loads(line[8:]) for line in log.splitlines() if line.startswith("OUTCOME ")]
            calls = [call for call in calls if call["scenario"] == scenario]
            assert [i for i, call in enumerate(calls) if call["raised"]] == raising, (scenario, calls)
            assert not any("not every process reached" in (call["raised"] or "") for call in calls), calls
        for directory in sorted((tmp_path / scenario).glob("out*")):
            files = sorted(p.name for p in directory.iterdir())
            if directory.name == "out" and left == "model":
                assert json.loads((directory / INDEX_NAME).read_text())["metadata"]["total_size"] == 4 * 256
            elif directory.name == "out2":  # the agreeing second calls
                assert INDEX_NAME in files and len(files) == 5, (scenario, files)
            else:
                assert files == [], (scenario, directory, files)


def test_an_object_store_directory_is_held_by_one_writer(tmp_path, s3):
    """Found by an outside attack: on S3 a slow overwrite=True writer replaced a shard of
    a model another writer had committed meanwhile. A writer now holds the prefix with
    the lease saves take: another is refused while it writes; none is left after."""
    from eqxckpt._paths import LEASE_NAME

    endpoint, client = s3
    spec = s3_spec(endpoint, f"held-{tmp_path.name}/")
    tensors = {k: np.full(64, i, np.float32) for i, k in enumerate("abcd")}
    with resolve(spec).publishing():
        with pytest.raises(eqxckpt.CheckpointBusyError, match="Another writer holds"):
            eqxckpt.save_safetensors(spec, tensors, max_shard_size=300, overwrite=True)
    eqxckpt.save_safetensors(spec, tensors, max_shard_size=300)
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=spec["path"])["Contents"]
    names = sorted(o["Key"][len(spec["path"]) :] for o in listed)
    assert names == sorted([*expected_files(dict(sorted(tensors.items())), 300, metadata=None)[0], INDEX_NAME])
    assert LEASE_NAME not in names


def test_a_writer_taken_over_on_s3_writes_nothing_more(tmp_path, s3):
    """Found by an outside attack: a writer stopped past its lease, then continued, wrote
    a shard (or the index) over the model the writer that took over had committed. Every
    write is now made on condition that the object is what it was when the writer took
    the prefix: a taken-over writer's next write is refused and changes nothing."""
    endpoint, _ = s3
    spec = s3_spec(endpoint, f"taken-{tmp_path.name}/")
    storage = resolve(spec)
    first = storage.put_file("model-00001-of-00002.safetensors", [b"first"], overwrite=True)
    seen = {"model-00001-of-00002.safetensors": first, INDEX_NAME: ""}
    # Another writer takes over: rewrites the shard and commits an index.
    storage.put_file("model-00001-of-00002.safetensors", [b"theirs"], overwrite=True)
    storage.put_file(INDEX_NAME, [b"{}"], overwrite=True)
    for name in seen:
        with pytest.raises(eqxckpt.CheckpointBusyError, match="another writer took it over"):
            storage.put_file(name, [b"stale"], overwrite=True, seen=seen[name])
    assert storage.read_small("model-00001-of-00002.safetensors", 100) == b"theirs"
    assert storage.read_small(INDEX_NAME, 100) == b"{}"
