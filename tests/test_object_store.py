"""save / load / open / inspect against real object-store APIs on 127.0.0.1: moto's S3
server and fake-gcs-server's Cloud Storage. Every test runs on both (the ``store``
fixture), except those that rely on conditional writes, which that Cloud Storage
emulator ignores (real Cloud Storage honours them): those run on S3."""

import json
import os
import subprocess
import sys
import time

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from conftest import BUCKET, assert_trees_equal, kill_when, s3_spec as spec

import eqxckpt
import eqxckpt._storage
from eqxckpt._cli import main as cli
from eqxckpt._lease import Lease, read_lease


def keys(client, prefix: str) -> list[str]:
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(obj["Key"] for obj in listing.get("Contents", []))


def make_state(seed: int) -> dict:
    model = eqx.nn.MLP(4, 3, 16, 2, key=jax.random.key(seed))
    opt_state = optax.adam(1e-3).init(eqx.filter(model, eqx.is_array))
    return {"model": model, "opt_state": opt_state, "step": seed, "rng": jax.random.key(seed)}


def test_save_load_open_round_trip(store):
    state = make_state(1)
    eqxckpt.save(store.spec("runs/a/1"), state, metadata={"step": 1})
    stored = store.keys("runs/a/1/")
    assert "runs/a/1/eqxckpt.json" in stored and "runs/a/1/model/layers/0/weight/zarr.json" in stored

    assert_trees_equal(eqxckpt.load(store.spec("runs/a/1"), state), state)
    model = eqxckpt.load(store.spec("runs/a/1"), lambda: make_state(9)["model"], at="model")
    assert_trees_equal(model, state["model"])
    assert eqxckpt.verify(store.spec("runs/a/1")).ok
    ckpt = eqxckpt.open(store.spec("runs/a/1/"))
    assert ckpt.metadata == {"step": 1} and ckpt["step"] == 1
    np.testing.assert_array_equal(
        ckpt["model/layers/0/weight"][:2].get(), np.asarray(state["model"].layers[0].weight[:2])
    )


def test_url_with_endpoint_from_environment_and_async_save(store, monkeypatch):
    if store.name == "s3":
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", store.endpoint)  # (GCS: TENSORSTORE_GCS_HTTP_URL, set by the fixture)
    state = make_state(2)
    handle = eqxckpt.save(store.url("runs/url/2"), state, blocking=False)
    handle.wait()
    assert_trees_equal(eqxckpt.load(store.spec("runs/url/2"), state), state)
    assert_trees_equal(eqxckpt.load(store.url("runs/url/2"), state), state)
    assert str(eqxckpt.open(store.url("runs/url/2")).location) == store.url("runs/url/2/")


def test_inspect_and_verify_from_the_command_line(store, capsys, monkeypatch):
    eqxckpt.save(store.spec("runs/cli/1"), {"w": np.zeros((8, 4), np.float32), "step": 5}, metadata={"who": "cli"})
    assert cli(["inspect", json.dumps(store.spec("runs/cli/1"))]) == 0
    out = capsys.readouterr().out
    assert "w  float32[8,4]  128 B" in out and "step  int = 5" in out and '"who": "cli"' in out
    if store.name == "s3":
        monkeypatch.setenv("AWS_ENDPOINT_URL", store.endpoint)
    assert cli(["inspect", store.url("runs/cli/1")]) == 0
    assert "w  float32[8,4]" in capsys.readouterr().out
    assert cli(["verify", store.url("runs/cli/1")]) == 0
    assert "OK" in capsys.readouterr().out
    # A copy inside the source prefix would land among its keys: refused before anything is written.
    assert cli(["convert", json.dumps(store.spec("runs/cli/1")), json.dumps(store.spec("runs/cli/1/copy"))]) == 1
    assert "one is inside the other" in capsys.readouterr().err
    assert not [key for key in store.keys("runs/cli/1/") if "/copy/" in key]


def test_overwrite_replaces_every_old_key(store):
    where = store.spec("runs/over")
    eqxckpt.save(where, {"old": np.ones(3), "kept": np.ones(2)})
    with pytest.raises(eqxckpt.CheckpointExistsError, match="overwrite=True"):
        eqxckpt.save(where, {"kept": np.zeros(2)})
    eqxckpt.save(where, {"kept": np.zeros(2)}, overwrite=True)
    assert not [k for k in store.keys("runs/over/") if k.startswith("runs/over/old")]
    np.testing.assert_array_equal(eqxckpt.load(where)["kept"], np.zeros(2))


KILLED_WRITER = """
import sys, numpy as np, eqxckpt
where = {spec!r}
eqxckpt.save(where, {{f"leaf{{i}}": np.full((512, 1024), i, np.float32) for i in range({leaves})}})
"""


def test_save_killed_before_its_manifest_is_refused_as_incomplete(store, monkeypatch):
    monkeypatch.setenv("EQXCKPT_LEASE_TIMEOUT_S", "2")  # the killed writer's lease is abandoned after 2 s
    for attempt, leaves in enumerate((48, 128, 256)):
        prefix = f"runs/killed{attempt}/"
        where = store.spec(prefix)
        # killed once its arrays exist on the server, before it commits
        kill_when(
            KILLED_WRITER.format(spec=where, leaves=leaves),
            lambda prefix=prefix: any(k.endswith("zarr.json") for k in store.keys(prefix)),
        )
        if prefix + "eqxckpt.json" not in store.keys(prefix):
            break
    else:
        pytest.fail("the writer always committed before it could be killed")

    with pytest.raises(eqxckpt.IncompleteCheckpointError, match="No committed checkpoint .* or was killed"):
        eqxckpt.load(where)
    with pytest.raises(eqxckpt.IncompleteCheckpointError):
        eqxckpt.open(where)
    assert cli(["inspect", json.dumps(where)]) == 1
    assert prefix + "eqxckpt.lease.json" in store.keys(prefix)  # the writer's lease names what it wrote
    lease = json.loads(store.get(prefix + "eqxckpt.lease.json"))
    assert lease["paths"] == sorted(f"leaf{i}" for i in range(leaves)) and lease["timeout_s"] == 2.0
    # Once the lease is abandoned, a new save reclaims exactly what it lists, then writes.
    time.sleep(max(0.0, lease["heartbeat_unix"] + lease["timeout_s"] - time.time()) + 0.1)
    eqxckpt.save(where, {"x": np.arange(3)})
    np.testing.assert_array_equal(eqxckpt.load(where)["x"], np.arange(3))
    assert not [k for k in store.keys(prefix) if "leaf" in k or "lease" in k]


def test_a_live_lease_makes_other_saves_wait_their_turn(s3):
    """S3 only: the racer's refusal relies on a conditional write."""
    endpoint, client = s3
    where = spec(endpoint, "runs/busy/")
    eqxckpt.save(where, {"x": np.zeros(3)})
    store = eqxckpt._storage.resolve(where).open_kvstore()
    lease = Lease(store, "save", ["x"], read_lease(store)[0].stamp.generation)  # another writer, alive
    with pytest.raises(eqxckpt.CheckpointBusyError, match="Another save or deletion holds .*pid"):
        eqxckpt.save(where, {"x": np.ones(3)}, overwrite=True)
    absent = store.read("no-such-key").result().stamp.generation
    with pytest.raises(eqxckpt.CheckpointBusyError):  # a racer who saw no lease cannot take one either
        Lease(store, "save", ["x"], absent)
    np.testing.assert_array_equal(eqxckpt.load(where)["x"], np.zeros(3))  # untouched
    lease.release()
    eqxckpt.save(where, {"x": np.ones(3)}, overwrite=True)
    np.testing.assert_array_equal(eqxckpt.load(where)["x"], np.ones(3))
    assert "runs/busy/eqxckpt.lease.json" not in keys(client, "runs/busy/")


FOREIGN = {
    "data/zarr.json": b'{"zarr_format": 3, "node_type": "array"}',  # a user's own zarr v3 array
    "data/c/0/0": b"\x00" * 16,
    "notes/c/todo.txt": b"buy milk",
    "README": b"mine",
}


def test_save_never_deletes_what_it_did_not_write(store):
    prefix = "runs/foreign/"
    for key, body in FOREIGN.items():
        store.put(prefix + key, body)
    where = store.spec(prefix)
    for overwrite in (False, True):
        with pytest.raises(eqxckpt.CheckpointExistsError, match="did not write"):
            eqxckpt.save(where, {"w": np.ones(3)}, overwrite=overwrite)
    assert store.keys(prefix) == sorted(prefix + k for k in FOREIGN)

    # Beside a committed checkpoint, foreign keys survive an overwrite, and the
    # new save refuses to write over a foreign key at one of its leaf paths.
    where = store.spec("runs/mixed/")
    eqxckpt.save(where, {"w": np.ones(3), "v": np.ones(2)})
    for key, body in FOREIGN.items():
        store.put("runs/mixed/" + key, body)
    store.put("runs/mixed/w/notes.txt", b"inside a leaf's directory")
    with pytest.raises(eqxckpt.CheckpointExistsError, match="at leaf 'data'"):
        eqxckpt.save(where, {"data": np.zeros(2)}, overwrite=True)
    np.testing.assert_array_equal(eqxckpt.load(where)["w"], np.ones(3))  # the refusal changed nothing
    eqxckpt.save(where, {"w": np.zeros(5)}, overwrite=True)
    assert_trees_equal(eqxckpt.load(where), {"w": np.zeros(5)})
    stored = store.keys("runs/mixed/")
    assert all("runs/mixed/" + k in stored for k in FOREIGN) and "runs/mixed/w/notes.txt" in stored
    assert not [k for k in stored if k.startswith("runs/mixed/v/")]  # the old leaf went, being ours
    for key in FOREIGN:
        assert store.get("runs/mixed/" + key) == FOREIGN[key]


def load_in_a_child(where: dict, **env: str) -> subprocess.CompletedProcess:
    """``eqxckpt.load(where)`` in a fresh interpreter (its endpoint settings read at start-up)."""
    return subprocess.run(
        [sys.executable, "-c", f"import eqxckpt; eqxckpt.load({where!r})"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, JAX_PLATFORMS="cpu", **env),
    )


def test_missing_bucket_and_unreachable_endpoint_are_clear_errors(s3, capsys):
    endpoint, _ = s3
    missing = {**spec(endpoint, "x/"), "bucket": "no-such-bucket"}
    for read in (eqxckpt.load, eqxckpt.open):
        with pytest.raises(eqxckpt.CheckpointNotFoundError, match="NoSuchBucket"):
            read(missing)
    assert cli(["inspect", json.dumps(missing)]) == 1
    assert "NoSuchBucket" in capsys.readouterr().err
    with pytest.raises(eqxckpt.CheckpointWriteError, match="NoSuchBucket.*create the bucket or fix its name"):
        eqxckpt.save(missing, {"x": np.zeros(2)})
    # Nothing listens on port 9: a bounded number of retries, then an error that says what to check.
    done = load_in_a_child(spec("http://127.0.0.1:9", "x/"), EQXCKPT_S3_RETRIES="1")
    assert done.returncode == 1 and "eqxckpt._errors.CheckpointError: Cannot read s3://" in done.stderr
    assert "Check the endpoint" in done.stderr


def test_a_run_directory_names_its_checkpoints(store):
    with eqxckpt.CheckpointManager(store.spec("runs/named/")) as manager:
        for step in (3, 12):
            manager.save(step, {"x": np.zeros(2)})
    with pytest.raises(
        eqxckpt.CheckpointNotFoundError, match=r"directory of 2 checkpoints \(a CheckpointManager run\): 3, 12"
    ):
        eqxckpt.load(store.spec("runs/named/"))


def test_a_missing_bucket_and_an_unreachable_endpoint_on_gcs_are_clear_errors(gcs):
    missing = {**gcs.spec("x/"), "bucket": "no-such-bucket"}
    for read in (eqxckpt.load, eqxckpt.open):
        with pytest.raises(eqxckpt.CheckpointNotFoundError, match="check the bucket's name"):
            read(missing)
    with pytest.raises(eqxckpt.CheckpointWriteError, match="NOT_FOUND.*create the bucket or fix its name"):
        eqxckpt.save(missing, {"x": np.zeros(2)})
    # Nothing listens on port 9: an error that says what to check, not a hang.
    done = load_in_a_child(gcs.spec("x/"), TENSORSTORE_GCS_HTTP_URL="http://127.0.0.1:9", EQXCKPT_GCS_RETRIES="1")
    assert done.returncode == 1 and "Cannot read gs://" in done.stderr and "TENSORSTORE_GCS_HTTP_URL" in done.stderr


def test_crafted_objects_are_refused(store):
    """A manifest or array metadata edited on the server: refused with the same errors as on disk."""
    where = store.spec("runs/crafted/")
    eqxckpt.save(where, {"w": np.arange(6, dtype=np.float32), "v": np.ones(3)})
    manifest = json.loads(store.get("runs/crafted/eqxckpt.json"))
    outside = json.loads(json.dumps(manifest))
    outside["leaves"][0]["path"] = outside["leaves"][0]["location"] = "../elsewhere"
    store.put("runs/crafted/eqxckpt.json", json.dumps(outside).encode())
    with pytest.raises(eqxckpt.ManifestError, match="unsafe segment"):
        eqxckpt.load(where)
    huge = json.loads(json.dumps(manifest))
    next(leaf for leaf in huge["leaves"] if leaf["path"] == "w")["shape"] = [1 << 40]
    store.put("runs/crafted/eqxckpt.json", json.dumps(huge).encode())
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="Leaf 'w'"):
        eqxckpt.load(where)
    store.put("runs/crafted/eqxckpt.json", json.dumps(manifest).encode())
    metadata = json.loads(store.get("runs/crafted/w/zarr.json"))
    metadata["codecs"] = [codec for codec in metadata["codecs"] if codec["name"] != "crc32c"]  # no checksum
    store.put("runs/crafted/w/zarr.json", json.dumps(metadata).encode())
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="Leaf 'w'"):
        eqxckpt.load(where)
    report = eqxckpt.verify(where)
    assert [path for path, _ in report.problems] == ["w"]
    np.testing.assert_array_equal(eqxckpt.load(where, at="v"), np.ones(3))  # the rest still reads


@pytest.mark.parametrize("heartbeat", ["NaN", "Infinity", "-Infinity", "true"])
def test_a_lease_that_could_never_go_stale_is_not_taken_for_a_live_one(store, heartbeat):
    """eqxckpt never writes such a lease: it is someone else's object, named as such,
    never a place that stays busy forever."""
    prefix = f"runs/lease-{heartbeat.lower().strip('-')}{'-neg' if heartbeat.startswith('-') else ''}/"
    lease = (
        '{"format": "eqxckpt-lease", "purpose": "save", "paths": ["w"], '
        f'"heartbeat_unix": {heartbeat}, "timeout_s": 600.0}}'
    )
    store.put(prefix + "eqxckpt.lease.json", lease.encode())
    with pytest.raises(eqxckpt.CheckpointExistsError, match="eqxckpt.lease.json that eqxckpt did not write"):
        eqxckpt.save(store.spec(prefix), {"w": np.ones(2)})
    assert store.keys(prefix) == [prefix + "eqxckpt.lease.json"]  # nothing deleted, nothing written
