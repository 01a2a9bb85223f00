"""save / load / open / inspect against a real S3 API: moto's server on 127.0.0.1."""

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


def test_save_load_open_round_trip(s3):
    endpoint, client = s3
    state = make_state(1)
    eqxckpt.save(spec(endpoint, "runs/a/1"), state, metadata={"step": 1})
    stored = keys(client, "runs/a/1/")
    assert "runs/a/1/eqxckpt.json" in stored and "runs/a/1/model/layers/0/weight/zarr.json" in stored

    assert_trees_equal(eqxckpt.load(spec(endpoint, "runs/a/1"), state), state)
    model = eqxckpt.load(spec(endpoint, "runs/a/1"), lambda: make_state(9)["model"], at="model")
    assert_trees_equal(model, state["model"])
    ckpt = eqxckpt.open(spec(endpoint, "runs/a/1/"))
    assert ckpt.metadata == {"step": 1} and ckpt["step"] == 1
    np.testing.assert_array_equal(
        ckpt["model/layers/0/weight"][:2].get(), np.asarray(state["model"].layers[0].weight[:2])
    )


def test_s3_url_with_endpoint_from_environment(s3, monkeypatch):
    endpoint, _ = s3
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    state = make_state(2)
    handle = eqxckpt.save(f"s3://{BUCKET}/runs/url/2", state, blocking=False)
    handle.wait()
    assert_trees_equal(eqxckpt.load(spec(endpoint, "runs/url/2"), state), state)
    assert_trees_equal(eqxckpt.load(f"s3://{BUCKET}/runs/url/2", state), state)


def test_inspect_on_s3(s3, capsys, monkeypatch):
    endpoint, _ = s3
    eqxckpt.save(spec(endpoint, "runs/cli/1"), {"w": np.zeros((8, 4), np.float32), "step": 5}, metadata={"who": "cli"})
    assert cli(["inspect", json.dumps(spec(endpoint, "runs/cli/1"))]) == 0
    out = capsys.readouterr().out
    assert "w  float32[8,4]  128 B" in out and "step  int = 5" in out and '"who": "cli"' in out
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    assert cli(["inspect", f"s3://{BUCKET}/runs/cli/1"]) == 0
    assert "w  float32[8,4]" in capsys.readouterr().out


def test_overwrite_replaces_every_old_key(s3):
    endpoint, client = s3
    where = spec(endpoint, "runs/over")
    eqxckpt.save(where, {"old": np.ones(3), "kept": np.ones(2)})
    with pytest.raises(eqxckpt.CheckpointExistsError, match="overwrite=True"):
        eqxckpt.save(where, {"kept": np.zeros(2)})
    eqxckpt.save(where, {"kept": np.zeros(2)}, overwrite=True)
    assert not [k for k in keys(client, "runs/over/") if k.startswith("runs/over/old")]
    np.testing.assert_array_equal(eqxckpt.load(where)["kept"], np.zeros(2))


KILLED_WRITER = """
import sys, numpy as np, eqxckpt
where = {spec!r}
eqxckpt.save(where, {{f"leaf{{i}}": np.full((512, 1024), i, np.float32) for i in range({leaves})}})
"""


def test_save_killed_before_its_manifest_is_refused_as_incomplete(s3, monkeypatch):
    endpoint, client = s3
    monkeypatch.setenv("EQXCKPT_LEASE_TIMEOUT_S", "2")  # the killed writer's lease is abandoned after 2 s
    for attempt, leaves in enumerate((48, 128, 256)):
        prefix = f"runs/killed{attempt}/"
        where = spec(endpoint, prefix)
        # killed once its arrays exist on the server, before it commits
        kill_when(
            KILLED_WRITER.format(spec=where, leaves=leaves),
            lambda prefix=prefix: any(k.endswith("zarr.json") for k in keys(client, prefix)),
        )
        if prefix + "eqxckpt.json" not in keys(client, prefix):
            break
    else:
        pytest.fail("the writer always committed before it could be killed")

    with pytest.raises(eqxckpt.IncompleteCheckpointError, match="No committed checkpoint .* or was killed"):
        eqxckpt.load(where)
    with pytest.raises(eqxckpt.IncompleteCheckpointError):
        eqxckpt.open(where)
    assert cli(["inspect", json.dumps(where)]) == 1
    assert prefix + "eqxckpt.lease.json" in keys(client, prefix)  # the writer's lease names what it wrote
    lease = json.loads(client.get_object(Bucket=BUCKET, Key=prefix + "eqxckpt.lease.json")["Body"].read())
    assert lease["paths"] == sorted(f"leaf{i}" for i in range(leaves)) and lease["timeout_s"] == 2.0
    # Once the lease is abandoned, a new save reclaims exactly what it lists, then writes.
    time.sleep(max(0.0, lease["heartbeat_unix"] + lease["timeout_s"] - time.time()) + 0.1)
    eqxckpt.save(where, {"x": np.arange(3)})
    np.testing.assert_array_equal(eqxckpt.load(where)["x"], np.arange(3))
    assert not [k for k in keys(client, prefix) if "leaf" in k or "lease" in k]


def test_a_live_lease_makes_other_saves_wait_their_turn(s3):
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


def test_save_never_deletes_what_it_did_not_write(s3):
    endpoint, client = s3
    prefix = "runs/foreign/"
    for key, body in FOREIGN.items():
        client.put_object(Bucket=BUCKET, Key=prefix + key, Body=body)
    where = spec(endpoint, prefix)
    for overwrite in (False, True):
        with pytest.raises(eqxckpt.CheckpointExistsError, match="did not write"):
            eqxckpt.save(where, {"w": np.ones(3)}, overwrite=overwrite)
    assert keys(client, prefix) == sorted(prefix + k for k in FOREIGN)

    # Beside a committed checkpoint, foreign keys survive an overwrite, and the
    # new save refuses to write over a foreign key at one of its leaf paths.
    where = spec(endpoint, "runs/mixed/")
    eqxckpt.save(where, {"w": np.ones(3), "v": np.ones(2)})
    for key, body in FOREIGN.items():
        client.put_object(Bucket=BUCKET, Key="runs/mixed/" + key, Body=body)
    client.put_object(Bucket=BUCKET, Key="runs/mixed/w/notes.txt", Body=b"inside a leaf's directory")
    with pytest.raises(eqxckpt.CheckpointExistsError, match="at leaf 'data'"):
        eqxckpt.save(where, {"data": np.zeros(2)}, overwrite=True)
    np.testing.assert_array_equal(eqxckpt.load(where)["w"], np.ones(3))  # the refusal changed nothing
    eqxckpt.save(where, {"w": np.zeros(5)}, overwrite=True)
    assert_trees_equal(eqxckpt.load(where), {"w": np.zeros(5)})
    stored = keys(client, "runs/mixed/")
    assert all("runs/mixed/" + k in stored for k in FOREIGN) and "runs/mixed/w/notes.txt" in stored
    assert not [k for k in stored if k.startswith("runs/mixed/v/")]  # the old leaf went, being ours
    for key in FOREIGN:
        assert client.get_object(Bucket=BUCKET, Key="runs/mixed/" + key)["Body"].read() == FOREIGN[key]


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
    unreachable = {**spec("http://127.0.0.1:9", "x/")}
    script = f"import eqxckpt; eqxckpt.load({unreachable!r})"
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, EQXCKPT_S3_RETRIES="1", JAX_PLATFORMS="cpu"),
    )
    assert done.returncode == 1 and "eqxckpt._errors.CheckpointError: Cannot read s3://" in done.stderr
    assert "Check the endpoint" in done.stderr


def test_a_run_directory_on_s3_names_its_checkpoints(s3):
    endpoint, _ = s3
    with eqxckpt.CheckpointManager(spec(endpoint, "runs/named/")) as manager:
        for step in (3, 12):
            manager.save(step, {"x": np.zeros(2)})
    with pytest.raises(
        eqxckpt.CheckpointNotFoundError, match=r"directory of 2 checkpoints \(a CheckpointManager run\): 3, 12"
    ):
        eqxckpt.load(spec(endpoint, "runs/named/"))
