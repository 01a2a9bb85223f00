"""save / load / open / inspect against real object-store APIs on 127.0.0.1: moto's S3
server and fake-gcs-server's Cloud Storage. Every test runs on both (the ``store``
fixture), except those that rely on conditional writes, which that Cloud Storage
emulator ignores (real Cloud Storage honours them): those run on S3."""

import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys
import threading
import time
import warnings

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
import tensorstore as ts
from conftest import BUCKET, ObjectStore, assert_trees_equal, crafted_manifest, kill_when, manifest_doc, s3_spec as spec

import eqxckpt
import eqxckpt._storage
from eqxckpt._cli import main as cli
from eqxckpt._paths import RUN_NAME
from eqxckpt._run._steps import clean_leftovers, read_run_id, run_identity_bytes, scan_steps
from eqxckpt._storage import _backend
from eqxckpt._storage._lease import Lease, holder_is_gone, read_lease


def keys(client, prefix: str) -> list[str]:
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(obj["Key"] for obj in listing.get("Contents", []))


def arrays_of(store, prefix: str) -> str:
    """The one save prefix (``%arrays.<hex>``) under ``prefix``, as the manifest names it."""
    names = {key[len(prefix) :].split("/")[0] for key in store.keys(prefix)}
    [name] = [n for n in names if n.startswith("%arrays.")]
    assert json.loads(store.get(prefix + "eqxckpt.json"))["arrays"] == name
    return name


def make_state(seed: int) -> dict:
    model = eqx.nn.MLP(4, 3, 16, 2, key=jax.random.key(seed))
    opt_state = optax.adam(1e-3).init(eqx.filter(model, eqx.is_array))
    return {"model": model, "opt_state": opt_state, "step": seed, "rng": jax.random.key(seed)}


def test_save_load_open_round_trip(store):
    state = make_state(1)
    eqxckpt.save(store.spec("runs/a/1"), state, metadata={"step": 1})
    stored = store.keys("runs/a/1/")
    arrays = arrays_of(store, "runs/a/1/")
    assert "runs/a/1/eqxckpt.json" in stored and f"runs/a/1/{arrays}/model/layers/0/weight/zarr.json" in stored
    assert all(k.startswith(f"runs/a/1/{arrays}/") for k in stored if not k.endswith("/eqxckpt.json"))
    # The save's prefix is a plain zarr v3 hierarchy: TensorStore's own driver reads it.
    direct = ts.open({"driver": "zarr3", "kvstore": store.spec(f"runs/a/1/{arrays}/model/layers/0/weight/")})
    np.testing.assert_array_equal(direct.result().read().result(), np.asarray(state["model"].layers[0].weight))

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
    first = arrays_of(store, "runs/over/")
    eqxckpt.save(where, {"kept": np.zeros(2)}, overwrite=True)
    assert arrays_of(store, "runs/over/") != first  # the old save's prefix went, whole
    assert not [k for k in store.keys("runs/over/") if "/old/" in k or first in k]
    np.testing.assert_array_equal(eqxckpt.load(where)["kept"], np.zeros(2))


KILLED_WRITER = """
import sys, numpy as np, eqxckpt
where = {spec!r}
eqxckpt.save(where, {{f"leaf{{i}}": np.full((512, 1024), i, np.float32) for i in range({leaves})}})
"""


@pytest.mark.multiprocess
def test_save_killed_before_its_manifest_is_refused_as_incomplete(store, monkeypatch):
    monkeypatch.setenv("EQXCKPT_LEASE_TIMEOUT_S", "2")  # the killed writer's lease is abandoned after 2 s
    prefix, where = killed_writer(store, "killed")
    lease = json.loads(store.get(prefix + "eqxckpt.lease.json"))
    assert holder_is_gone(lease)  # killed on this machine (the next test)
    # As if it had run on another machine, where only the clock tells a dead writer.
    store.put(prefix + "eqxckpt.lease.json", json.dumps({**lease, "boot_id": "another machine"}).encode())
    with pytest.raises(eqxckpt.IncompleteCheckpointError, match="No committed checkpoint .* or was killed"):
        eqxckpt.load(where)
    with pytest.raises(eqxckpt.IncompleteCheckpointError):
        eqxckpt.open(where)
    assert cli(["inspect", json.dumps(where)]) == 1
    assert prefix + "eqxckpt.lease.json" in store.keys(prefix)  # the writer's lease names what it wrote
    lease = json.loads(store.get(prefix + "eqxckpt.lease.json"))
    [killed] = lease["arrays"]
    assert lease["action"] == "save" and lease["timeout_s"] == 2.0
    assert all(k.startswith(f"{prefix}{killed}/") for k in store.keys(prefix) if "lease" not in k)
    # Once the lease is abandoned, a new save deletes the prefix it names, then writes its own.
    time.sleep(max(0.0, lease["heartbeat_unix"] + lease["timeout_s"] - time.time()) + 0.1)
    eqxckpt.save(where, {"x": np.arange(3)})
    np.testing.assert_array_equal(eqxckpt.load(where)["x"], np.arange(3))
    assert not [k for k in store.keys(prefix) if "leaf" in k or "lease" in k or killed in k]


def killed_writer(store, name: str) -> tuple[str, dict]:
    """A place where a writer was SIGKILLed once its arrays were on the server, before it
    committed: (its prefix, its spec)."""
    for attempt, leaves in enumerate((48, 128, 256)):
        prefix = f"runs/{name}{attempt}/"
        where = store.spec(prefix)
        kill_when(
            KILLED_WRITER.format(spec=where, leaves=leaves),
            lambda prefix=prefix: any(k.endswith("zarr.json") for k in store.keys(prefix)),
        )
        if prefix + "eqxckpt.json" not in store.keys(prefix):
            return prefix, where
    pytest.fail("the writer always committed before it could be killed")


@pytest.mark.multiprocess
def test_a_save_killed_on_this_machine_frees_its_place_at_once(store, monkeypatch):
    """Its lease records the holder's kernel boot, pid namespace, pid and start time: a
    reader or a save on the same machine sees that the holder is dead, and nobody waits
    out the lease's timeout (600 s here) to save there again."""
    monkeypatch.delenv("EQXCKPT_LEASE_TIMEOUT_S", raising=False)
    prefix, where = killed_writer(store, "killed-here")
    lease = json.loads(store.get(prefix + "eqxckpt.lease.json"))
    assert lease["timeout_s"] == 600.0 and time.time() < lease["heartbeat_unix"] + 600
    assert lease["boot_id"] and lease["pid_namespace"].startswith("pid:") and lease["pid_started"] > 0
    with pytest.raises(eqxckpt.IncompleteCheckpointError, match="no save committed a checkpoint there"):
        eqxckpt.load(where)
    eqxckpt.save(where, {"x": np.arange(3)})
    np.testing.assert_array_equal(eqxckpt.load(where)["x"], np.arange(3))
    [killed] = lease["arrays"]
    assert not [k for k in store.keys(prefix) if "leaf" in k or "lease" in k or killed in k]


def test_a_lease_holder_is_gone_only_where_this_machine_can_tell():
    """`holder_is_gone`: a live holder (this process) is not; the same pid with another
    start time (a reused pid), a pid with no process and a zombie are; a holder in another
    boot or pid namespace, or one that recorded nothing, is left to the clock."""
    store = ts.KvStore.open({"driver": "memory"}).result()
    absent = store.read("eqxckpt.lease.json").result().stamp.generation
    mine = Lease(store, "save", absent, action="save", arrays=["%arrays." + "0" * 32]).doc
    assert not holder_is_gone(mine)
    assert holder_is_gone({**mine, "pid_started": mine["pid_started"] + 1})
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    with open(f"/proc/{child.pid}/stat") as stat:  # opened before it exits: the pid is not reused meanwhile
        while stat.read().split(")")[-1].split()[0] != "Z":  # exited, not yet waited for: a zombie
            assert time.monotonic() < deadline
            time.sleep(0.01)
            stat.seek(0)
    assert holder_is_gone({**mine, "pid": child.pid})
    child.wait()
    assert holder_is_gone({**mine, "pid": child.pid})  # no such process (until the pid is reused)
    for other in ({"boot_id": "another machine"}, {"pid_namespace": "pid:[1]"}, {"pid_started": None}, {"pid": True}):
        assert not holder_is_gone({**mine, **other, "pid": other.get("pid", 1 << 30)})
    assert not holder_is_gone({k: v for k, v in mine.items() if k != "boot_id"} | {"pid": 1 << 30})


def test_a_live_lease_makes_other_saves_wait_their_turn(s3):
    """S3 only: the racer's refusal relies on a conditional write."""
    endpoint, client = s3
    where = spec(endpoint, "runs/busy/")
    eqxckpt.save(where, {"x": np.zeros(3)})
    store = eqxckpt._storage.resolve(where).open_kvstore()
    seen = read_lease(store)[0].stamp.generation
    lease = Lease(store, "save", seen, action="save", arrays=["%arrays." + "0" * 32])  # another writer, alive
    with pytest.raises(eqxckpt.CheckpointBusyError, match="Another save or deletion holds .*pid"):
        eqxckpt.save(where, {"x": np.ones(3)}, overwrite=True)
    absent = store.read("no-such-key").result().stamp.generation
    with pytest.raises(eqxckpt.CheckpointBusyError):  # a racer who saw no lease cannot take one either
        Lease(store, "save", absent, action="save")
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

    # Beside a committed checkpoint, foreign keys survive overwrites, even where a
    # leaf of the same name is saved: each save's arrays are under a prefix of its own.
    where = store.spec("runs/mixed/")
    eqxckpt.save(where, {"w": np.ones(3), "v": np.ones(2)})
    first = arrays_of(store, "runs/mixed/")
    for key, body in FOREIGN.items():
        store.put("runs/mixed/" + key, body)
    eqxckpt.save(where, {"data": np.zeros(2)}, overwrite=True)
    np.testing.assert_array_equal(eqxckpt.load(where)["data"], np.zeros(2))
    eqxckpt.save(where, {"w": np.zeros(5)}, overwrite=True)
    assert_trees_equal(eqxckpt.load(where), {"w": np.zeros(5)})
    stored = store.keys("runs/mixed/")
    assert all("runs/mixed/" + k in stored for k in FOREIGN)
    assert not [k for k in stored if first in k]  # the old save's arrays went, being ours
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


@pytest.mark.multiprocess
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
    # Nothing listens on port 9: at once, one line that says what to check, and no AWS log lines.
    done = load_in_a_child(spec("http://127.0.0.1:9", "x/"))
    assert done.returncode == 1 and "eqxckpt._errors.CheckpointError: Cannot reach s3://" in done.stderr
    assert "127.0.0.1:9 refuses connections. Check the endpoint" in done.stderr
    assert not [line for line in done.stderr.splitlines() if line.startswith("E1")]


def test_an_endpoint_whose_name_does_not_resolve_fails_at_once(monkeypatch):
    """As for a bucket on AWS from a machine offline. (The resolver is made to fail here:
    the suite sends nothing beyond 127.0.0.1, not even a DNS query.)"""
    import socket

    from eqxckpt._storage import _objects

    def unresolvable(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unresolvable)
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "TENSORSTORE_GCS_HTTP_URL", *_objects._PROXIES):
        monkeypatch.delenv(name, raising=False)
    for where, endpoint in [
        ({"driver": "s3", "bucket": "my-bucket", "path": "x/"}, "S3 endpoint s3.amazonaws.com:443"),
        ({"driver": "gcs", "bucket": "my-bucket", "path": "x/"}, "Cloud Storage endpoint storage.googleapis.com:443"),
    ]:
        with pytest.raises(eqxckpt.CheckpointError, match=f"{endpoint} is a name that does not resolve"):
            _objects.check_reachable(where, "there")


def test_a_run_directory_names_its_checkpoints(store):
    with eqxckpt.CheckpointManager(store.spec("runs/named/")) as manager:
        for step in (3, 12):
            manager.save(step, {"x": np.zeros(2)})
    with pytest.raises(
        eqxckpt.CheckpointNotFoundError, match=r"directory of 2 checkpoints \(a CheckpointManager run\): 3, 12"
    ):
        eqxckpt.load(store.spec("runs/named/"))


@pytest.mark.multiprocess
def test_a_missing_bucket_and_an_unreachable_endpoint_on_gcs_are_clear_errors(gcs):
    missing = {**gcs.spec("x/"), "bucket": "no-such-bucket"}
    for read in (eqxckpt.load, eqxckpt.open):
        with pytest.raises(eqxckpt.CheckpointNotFoundError, match="check the bucket's name"):
            read(missing)
    with pytest.raises(eqxckpt.CheckpointWriteError, match="NOT_FOUND.*create the bucket or fix its name"):
        eqxckpt.save(missing, {"x": np.zeros(2)})
    # Nothing listens on port 9: an error that says what to check, not a hang.
    done = load_in_a_child(gcs.spec("x/"), TENSORSTORE_GCS_HTTP_URL="http://127.0.0.1:9")
    assert done.returncode == 1 and "Cannot reach gs://" in done.stderr and "TENSORSTORE_GCS_HTTP_URL" in done.stderr


def test_crafted_objects_are_refused(store):
    """A manifest or array metadata edited on the server: refused with the same errors as on disk."""
    where = store.spec("runs/crafted/")
    eqxckpt.save(where, {"w": np.arange(6, dtype=np.float32), "v": np.ones(3)})
    manifest = manifest_doc(store.get("runs/crafted/eqxckpt.json"))
    outside = json.loads(json.dumps(manifest))
    outside["leaves"][0]["path"] = outside["leaves"][0]["location"] = "../elsewhere"
    store.put("runs/crafted/eqxckpt.json", crafted_manifest(outside))
    with pytest.raises(eqxckpt.ManifestError, match="unsafe segment"):
        eqxckpt.load(where)
    huge = json.loads(json.dumps(manifest))
    next(leaf for leaf in huge["leaves"] if leaf["path"] == "w")["shape"] = [1 << 40]
    store.put("runs/crafted/eqxckpt.json", crafted_manifest(huge))
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="Leaf 'w'"):
        eqxckpt.load(where)
    for arrays in ("../elsewhere", "%arrays.x", "%packed"):  # only a save's own prefix, by its exact form
        store.put("runs/crafted/eqxckpt.json", crafted_manifest({**manifest, "arrays": arrays}))
        with pytest.raises(eqxckpt.ManifestError, match="versions 3 and 4 name where its arrays are"):
            eqxckpt.load(where)
    # A leaf may name only a sibling checkpoint's own prefix, and only in a version-4 manifest.
    prefix = "%arrays." + "0" * 32
    for ref in ("../../x/" + prefix, "/" + prefix, "../1/%packed", "../eqxckpt.json/" + prefix, f"../../{prefix}"):
        crafted = json.loads(json.dumps(manifest))
        crafted["version"] = 4
        next(leaf for leaf in crafted["leaves"] if leaf["path"] == "w")["arrays"] = ref
        store.put("runs/crafted/eqxckpt.json", crafted_manifest(crafted))
        with pytest.raises(eqxckpt.ManifestError, match="must be '../<checkpoint beside this one>/"):
            eqxckpt.load(where)
    for version, ref in ((3, f"../1/{prefix}"), (4, None)):
        crafted = json.loads(json.dumps(manifest))
        crafted["version"] = version
        if ref is not None:
            next(leaf for leaf in crafted["leaves"] if leaf["path"] == "w")["arrays"] = ref
        store.put("runs/crafted/eqxckpt.json", crafted_manifest(crafted))
        with pytest.raises(eqxckpt.ManifestError, match="only version 4 has such leaves"):
            eqxckpt.load(where)
    store.put("runs/crafted/eqxckpt.json", crafted_manifest(manifest))
    leaf_metadata = f"runs/crafted/{manifest['arrays']}/w/zarr.json"
    metadata = json.loads(store.get(leaf_metadata))
    metadata["codecs"] = [codec for codec in metadata["codecs"] if codec["name"] != "crc32c"]  # no checksum
    store.put(leaf_metadata, json.dumps(metadata).encode())
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


KILLED_AT = """
import os, signal, numpy as np, eqxckpt, eqxckpt._storage._objects as objects
def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
objects.{point} = die
eqxckpt.save({spec!r}, {{"w": np.full((64, 64), 2.0, np.float32), "v": np.arange(5)}}, overwrite=True)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "point, committed",
    [
        ("check_complete", False),  # killed before it staged its manifest: cleanup deletes its prefix
        ("write_manifest", True),  # killed after marking its lease as committing: cleanup commits it
        ("delete_unheld", True),  # killed once committed, before retiring what it replaced: cleanup retires it
    ],
)
def test_a_writer_killed_during_its_commit_is_finished_by_cleanup(store, monkeypatch, point, committed):
    """SIGKILL at a chosen instant of the commit. Until the lease times out the old step is
    still there, whole; then a manager opening the run finishes what the writer began."""
    monkeypatch.setenv("EQXCKPT_LEASE_TIMEOUT_S", "1")
    run = store.spec(f"runs/killed-{point}/")
    with eqxckpt.CheckpointManager(run) as manager:
        manager.save(5, {"w": np.full((64, 64), 1.0, np.float32), "v": np.arange(5)})
    step = {**run, "path": run["path"] + "5/"}
    done = subprocess.run(
        [sys.executable, "-c", KILLED_AT.format(point=point, spec=step)], env=dict(os.environ, JAX_PLATFORMS="cpu")
    )
    assert done.returncode == -9
    assert "eqxckpt.lease.json" in [k.split("/")[-1] for k in store.keys(run["path"] + "5/")]
    # The old one, whole, until the commit's write; after it, the new one (the old one's
    # prefix stays until cleanup finishes what the lease names).
    np.testing.assert_array_equal(eqxckpt.load(step)["w"], np.full((64, 64), 2.0 if point == "delete_unheld" else 1.0))
    time.sleep(1.1)
    with eqxckpt.CheckpointManager(run) as manager:
        assert manager.all_steps() == [5]
        np.testing.assert_array_equal(manager.load()["w"], np.full((64, 64), 2.0 if committed else 1.0))
    assert eqxckpt.verify(step).ok
    names = {k.split("/")[3] for k in store.keys(run["path"] + "5/")}
    assert len([n for n in names if n.startswith("%arrays.")]) == 1 and "eqxckpt.lease.json" not in names


def test_a_manifest_whose_arrays_were_deleted_is_no_checkpoint(store):
    """What a writer that resumes after its commit was rolled forward and deleted can leave:
    readers refuse it, and a save replaces it without overwrite=True."""
    where = store.spec("runs/stray/")
    eqxckpt.save(where, {"w": np.ones(3)})
    arrays = arrays_of(store, "runs/stray/")
    store.delete(f"runs/stray/{arrays}/eqxckpt.commit.json")
    with pytest.raises(eqxckpt.IncompleteCheckpointError, match="names arrays .* that were deleted"):
        eqxckpt.load(where)
    eqxckpt.save(where, {"w": np.zeros(3)})
    np.testing.assert_array_equal(eqxckpt.load(where)["w"], np.zeros(3))
    assert not [k for k in store.keys("runs/stray/") if arrays in k]


def test_checkpoints_from_before_prefixes_load_and_are_replaced_and_deleted(store, tmp_path):
    """A checkpoint on an object store without "arrays" (versions 1 and 2, or a local
    one copied up, as here) keeps its arrays beside its manifest: it loads; an overwrite and retention remove
    exactly its keys, and nothing else."""
    tree = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "small": [np.ones(2), np.zeros(3)]}
    eqxckpt.save(tmp_path / "old", tree)
    for step in ("1", "2"):
        for file in (tmp_path / "old").rglob("*"):
            if file.is_file():
                store.put(f"runs/legacy/{step}/{file.relative_to(tmp_path / 'old')}", file.read_bytes())
    store.put("runs/legacy/1/notes.txt", b"mine")
    first = store.spec("runs/legacy/1/")
    assert "arrays" not in json.loads(store.get("runs/legacy/1/eqxckpt.json"))  # beside it, as before prefixes
    assert_trees_equal(eqxckpt.load(first), tree)
    assert eqxckpt.verify(first).ok
    eqxckpt.save(first, {"w": np.zeros(2)}, overwrite=True)
    assert_trees_equal(eqxckpt.load(first), {"w": np.zeros(2)})
    left = [k for k in store.keys("runs/legacy/1/") if not k.split("/")[3].startswith("%arrays.")]
    assert left == ["runs/legacy/1/eqxckpt.json", "runs/legacy/1/notes.txt"]
    with eqxckpt.CheckpointManager(store.spec("runs/legacy/"), max_to_keep=1) as manager:
        manager.save(3, {"w": np.ones(2)})
    assert manager.all_steps() == [3] and store.keys("runs/legacy/1/") == ["runs/legacy/1/notes.txt"]
    assert store.keys("runs/legacy/2/") == []


def test_a_copy_on_a_local_disk_reads_the_same(store, tmp_path):
    where = store.spec("runs/copy/")
    tree = {"w": np.arange(6.0), "n": 3}
    eqxckpt.save(where, tree)
    for key in store.keys("runs/copy/"):
        target = tmp_path / "copy" / key[len("runs/copy/") :]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(store.get(key))
    assert_trees_equal(eqxckpt.load(tmp_path / "copy"), tree)
    assert eqxckpt.verify(tmp_path / "copy").ok
    # Its prefix moved out and linked back: never followed out of the checkpoint.
    arrays = json.loads((tmp_path / "copy" / "eqxckpt.json").read_text())["arrays"]
    (tmp_path / "copy" / arrays).rename(tmp_path / "outside")
    (tmp_path / "copy" / arrays).symlink_to(tmp_path / "outside")
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="symlink or special file"):
        eqxckpt.load(tmp_path / "copy")
    assert not eqxckpt.verify(tmp_path / "copy").ok


@pytest.mark.parametrize("arrays", [[], ["%arrays." + "1" * 32, "%arrays." + "2" * 32]])
def test_an_abandoned_commit_lease_naming_no_single_prefix_is_not_eqxckpts(store, arrays):
    """A commit names exactly its own prefix. A lease that says otherwise was not written by
    eqxckpt: cleanup leaves it and everything else alone, and a save there is refused."""
    prefix = f"runs/odd-commit-{len(arrays)}/"
    lease = {
        "format": "eqxckpt-lease",
        "purpose": "save",
        "action": "commit",
        "arrays": arrays,
        "paths": [],
        "base": "",
        "heartbeat_unix": 0.0,
        "timeout_s": 1.0,
    }
    store.put(prefix + "eqxckpt.lease.json", json.dumps(lease).encode())
    with pytest.raises(eqxckpt.CheckpointExistsError, match="eqxckpt.lease.json that eqxckpt did not write"):
        eqxckpt.save(store.spec(prefix), {"w": np.ones(2)})
    assert store.keys(prefix) == [prefix + "eqxckpt.lease.json"]


# --- incremental saves: holds on a sibling's prefix, and deleting around them -------------


def test_a_deletion_never_removes_what_a_save_in_flight_refers_to(store, monkeypatch, tmp_path):
    """The hold protocol, each interleaving made to happen: a save in flight holds the
    prefix it refers to, so deleting that checkpoint keeps the prefix (retired) until the
    save ends; a save that finds the prefix marked doomed, or gone, writes the leaf itself;
    a hold taken after the deleter looked but before it marked the prefix doomed is seen
    by the deleter's second look."""
    from eqxckpt._storage import _holds

    top = f"holds-{store.name}/"
    frozen = np.arange(50_000, dtype=np.float32)
    eqxckpt.save(store.spec(top + "1"), {"frozen": frozen})
    prefix = arrays_of(store, top + "1/")
    ref = f"../1/{prefix}"

    def begin(step: str):  # a save to `step` that has taken its lease and holds the prefix
        staging = eqxckpt._storage.resolve(store.spec(top + step)).begin_save(["frozen"], False)
        return staging, staging.refer([ref])

    def holds() -> list[str]:
        return [k.split("%holds/")[1] for k in store.keys(f"{top}1/{prefix}/%holds/")]

    staging, held = begin("2")
    assert held == {ref} and holds() == [f"2/{staging.where}"]
    assert eqxckpt._storage.resolve(store.spec(top + "1")).delete()
    assert f"{top}1/{prefix}/frozen/zarr.json" in store.keys(top + "1/")  # kept for the save in flight
    assert dict(eqxckpt._storage.resolve(store.spec(top)).entries())["1"] == "retired"
    with pytest.raises(eqxckpt.IncompleteCheckpointError, match="has data but no eqxckpt.json"):
        eqxckpt.load(store.spec(top + "1"))
    staging.abort(RuntimeError("stopped"))  # the save ends without committing: its hold is dead
    eqxckpt.CheckpointManager(store.spec(top))  # opening a run collects what nothing holds
    assert store.keys(top) == []

    # Marked doomed (a deleter between its mark and its deletion): the save writes the leaf.
    eqxckpt.save(store.spec(top + "1"), {"frozen": frozen})
    prefix = arrays_of(store, top + "1/")
    ref = f"../1/{prefix}"
    store.put(f"{top}1/{prefix}/%doomed", b"")
    eqxckpt.save(store.spec(top + "2"), {"frozen": frozen}, base=store.spec(top + "1"))
    assert "arrays" not in manifest_doc(store.get(top + "2/eqxckpt.json"))["leaves"][0]
    assert holds() == []  # the refused hold was taken back
    np.testing.assert_array_equal(eqxckpt.load(store.spec(top + "2"))["frozen"], frozen)
    store.delete(f"{top}1/{prefix}/%doomed")

    # A hold taken in the deleter's blind spot: after its first look, before its mark.
    look = _holds._holds_live
    late: list = []

    def first_look_then_a_save_holds(s, run, name):
        found = look(s, run, name)
        if not late:
            late.append(begin("3"))
        return found

    monkeypatch.setattr(_holds, "_holds_live", first_look_then_a_save_holds)
    assert _holds.delete_unheld(eqxckpt._storage.resolve(store.spec(top + "1")).open_kvstore(), [prefix]) == []
    monkeypatch.setattr(_holds, "_holds_live", look)
    [(staging, held)] = late
    assert held == {ref} and f"{top}1/{prefix}/%doomed" in store.keys(top)  # kept, and stays doomed
    staging.abort(RuntimeError("stopped"))
    eqxckpt.save(store.spec(top + "4"), {"frozen": frozen}, base=store.spec(top + "1"))  # doomed: written
    assert "arrays" not in manifest_doc(store.get(top + "4/eqxckpt.json"))["leaves"][0]

    # A prefix gone altogether: nothing to hold.
    eqxckpt.save(store.spec(top + "5"), {"frozen": frozen})
    gone = arrays_of(store, top + "5/")
    for key in store.keys(f"{top}5/{gone}/"):
        store.delete(key)
    _, held = begin("6")
    assert held == set()


def test_references_reach_only_siblings_and_only_object_stores_keep_them(store, tmp_path):
    """A base that is not beside the new checkpoint is not referred to (everything is written);
    a copy of a referring step on a local disk is refused at open, with what to do."""
    x = np.arange(10_000, dtype=np.float32)
    top = f"siblings-{store.name}/"
    eqxckpt.save(store.spec(top + "a/1"), {"x": x})
    eqxckpt.save(store.spec(top + "b/2"), {"x": x}, base=store.spec(top + "a/1"))  # another directory
    assert "arrays" not in manifest_doc(store.get(top + "b/2/eqxckpt.json"))["leaves"][0]
    eqxckpt.save(store.spec(top + "a/3"), {"x": x}, base=store.spec(top + "a/1"))
    manifest = manifest_doc(store.get(top + "a/3/eqxckpt.json"))
    assert manifest["version"] == 5 and manifest["leaves"][0]["arrays"].startswith("../1/%arrays.")
    np.testing.assert_array_equal(eqxckpt.load(store.spec(top + "a/3"))["x"], x)
    for key in store.keys(top + "a/"):  # the whole run, copied to a local disk
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_bytes(store.get(key))
    with pytest.raises(eqxckpt.CheckpointError, match="can only be read and managed there"):
        eqxckpt.load(tmp_path / top / "a/3")


# --- reads are bounded before they allocate ------------------------------------------------


def probe_in_a_child(store, ops: str, prefix: str) -> dict:
    """Run ``bomb_probe.py`` (a fresh process) on the checkpoint at ``prefix``: {op: result}."""
    from conftest import WORKERS

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if store.name == "s3":
        env["AWS_ENDPOINT_URL_S3"] = store.endpoint
    done = subprocess.run(
        [sys.executable, str(WORKERS / "bomb_probe.py"), ops, store.url(prefix)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    for result in results:  # the figures, for the record (-s)
        print(f"{store.name} {result['op']}: {result['error']}, peak {result['peak_mib']:.1f} MiB")
    return {result["op"]: result for result in results}


@pytest.mark.multiprocess
def test_a_load_racing_an_overwrite_reads_the_new_checkpoint(store, monkeypatch):
    """Another save overwrites the checkpoint between a reader's read of the manifest and
    its check that the prefix it names is committed (here: injected at that instant by
    running the overwrite inside that check). The old prefix is then retired and gone
    and the new one not yet named by what the reader read: `load` reads the new
    checkpoint, never calls it damaged (it raised ManifestError "damaged manifest",
    which a manager records as a step never to be saved over)."""
    from eqxckpt._storage import _objects

    place = store.spec(f"race-{store.name}/step/")
    eqxckpt.save(place, {"w": np.arange(4.0)})
    check, raced = _objects.exists, []

    def exists_after_an_overwrite(kvstore, key):
        if not raced and key.endswith("eqxckpt.commit.json"):
            raced.append(True)
            eqxckpt.save(place, {"w": np.arange(4.0) + 1}, overwrite=True)  # the other process, now
        return check(kvstore, key)

    monkeypatch.setattr(_objects, "exists", exists_after_an_overwrite)
    loaded = eqxckpt.load(place, {"w": np.zeros(4)})
    assert raced and (loaded["w"] == np.arange(4.0) + 1).all()


def test_an_oversized_object_is_refused_without_downloading_it(store):
    """256 MiB where a 4 KiB chunk should be, then 128 MiB where a zarr.json should be:
    load, get and verify refuse each after downloading at most a few bytes more than
    expected (peak memory measured in a fresh process; it was 3x the object's size)."""
    prefix = f"bombs-{store.name}/"
    eqxckpt.save(store.spec(prefix), {"w": np.arange(1024, dtype=np.float32)})
    arrays = arrays_of(store, prefix)
    chunk = f"{prefix}{arrays}/w/c/0"
    assert len(store.get(chunk)) == 4100  # 4 KiB of float32 and a CRC-32C
    store.put(chunk, bytes(256 << 20))
    for op, result in probe_in_a_child(store, "load,get,verify", prefix).items():
        assert result["error"] in ("CorruptCheckpointError", "VerifyReport"), (op, result)
        assert "holds more than 4100 bytes, not 4100" in result["message"], (op, result)
        assert result["peak_mib"] < 64, (op, result)  # MiB: nothing near the object's size
    store.put(chunk, bytes(4099))  # one byte short: its size is named
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="holds 4099 bytes, not 4100"):
        eqxckpt.load(store.spec(prefix))

    eqxckpt.save(store.spec(prefix), {"w": np.arange(1024, dtype=np.float32)}, overwrite=True)
    arrays = arrays_of(store, prefix)
    store.put(f"{prefix}{arrays}/w/zarr.json", b" " * (128 << 20))
    result = probe_in_a_child(store, "load", prefix)["load"]
    assert result["error"] == "CorruptCheckpointError" and "over 65536 bytes" in result["message"], result
    assert result["peak_mib"] < 64, result


def test_a_refused_save_names_the_credentials(monkeypatch):
    """A server that refuses every request as S3 does without valid credentials: 403, and
    no body to a HEAD. The advice is about credentials, not disk space."""
    import http.server
    import threading

    class Refuse(http.server.BaseHTTPRequestHandler):
        def refuse(self) -> None:
            self.send_response(403)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = refuse

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrong")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    monkeypatch.setenv("TENSORSTORE_S3_USE_CONDITIONAL_WRITE", "1")  # no warning, whichever test ran first
    try:
        with pytest.raises(eqxckpt.CheckpointWriteError) as info:
            eqxckpt.save(spec(f"http://127.0.0.1:{server.server_port}", "run/"), {"w": np.ones(3)})
    finally:
        server.shutdown()
    message = str(info.value)
    assert "403" in message and "check the credentials (for S3, AWS_ACCESS_KEY_ID" in message, message
    assert "free space" not in message


def test_chunk_requests_are_in_flight_together_and_large_chunks_are_read_in_ranges(store, monkeypatch):
    """With every request held 50 ms at a proxy, a save and a load have requests for more
    chunks in flight at once than there are I/O threads (at most `IO_THREADS` while each
    request held one). A chunk over `PART_BYTES` is read as ranges at once, bit-exact; one
    that fails its checksum or is of another size is refused naming its leaf, and nothing
    is in flight any more when the load raises."""
    from conftest import CountingProxy

    from eqxckpt._storage._kvstore import PART_BYTES
    from eqxckpt._window import IO_THREADS

    proxy = CountingProxy(store.endpoint, delay=0.05, counted=lambda key: "/c/" in key or key.endswith("/c"))
    prefix = f"in-flight-{store.name}/"
    if store.name == "s3":
        spec = {**store.spec(prefix), "endpoint": proxy.endpoint}
    else:
        monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", proxy.endpoint)
        # A context of its own: TensorStore keeps an open driver per context, with its endpoint.
        spec = {**store.spec(prefix), "context": {"gcs_request_retries": {"max_retries": 5}}}
    rng = np.random.default_rng(0)
    tree = {f"w{i:02d}": rng.standard_normal(1 << 18, dtype=np.float32) for i in range(24)}  # 1 MiB each
    tree["big"] = rng.standard_normal((5 << 19) + 3, dtype=np.float32)  # 10 MiB + 12 B: two ranges
    try:
        eqxckpt.save(spec, tree)
        assert max(proxy.peak_keys.get("PUT", 0), proxy.peak_keys.get("POST", 0)) > IO_THREADS, proxy.peak_keys
        proxy.reset()
        loaded = eqxckpt.load(spec)
        assert proxy.peak_keys["GET"] > IO_THREADS, proxy.peak_keys
        for name, value in tree.items():
            assert np.asarray(loaded[name]).tobytes() == value.tobytes(), name
        size = tree["big"].nbytes + 4
        ranges = sorted(r for method, key, r in proxy.requests if method == "GET" and "/big/c/0" in key)
        expected = [(0, PART_BYTES - 1), (PART_BYTES, size - 1), (size, size)]
        assert sorted(tuple(map(int, r.removeprefix("bytes=").split("-"))) for r in ranges) == expected, ranges

        arrays = arrays_of(store, prefix)
        chunk, good = f"{prefix}{arrays}/big/c/0", store.get(f"{prefix}{arrays}/big/c/0")
        for bad, why in [
            (good[:9] + bytes([good[9] ^ 1]) + good[10:], "fails its CRC-32C checksum"),
            (good[:-1], f"holds {size - 1} bytes, not {size}"),
            (good + b"\0", f"holds more than {size} bytes, not {size}"),
        ]:
            store.put(chunk, bad)
            with pytest.raises(eqxckpt.CorruptCheckpointError, match=f"Leaf 'big'.*{why}"):
                eqxckpt.load(spec)
            assert proxy.active == 0
        store.put(chunk, good)
        flipped = f"{prefix}{arrays}/w05/c/0"  # among many reads in flight
        store.put(flipped, bytes([store.get(flipped)[0] ^ 1]) + store.get(flipped)[1:])
        with pytest.raises(eqxckpt.CorruptCheckpointError, match="Leaf 'w05'.*CRC-32C"):
            eqxckpt.load(spec)
        assert proxy.active == 0
    finally:
        proxy.close()


@pytest.mark.parametrize("fault", ["short", "long"])
def test_a_part_of_the_wrong_length_is_not_called_a_file_of_the_wrong_size(s3, monkeypatch, fault):
    """One ranged part of a chunk comes back 10 bytes short (or long) from a proxy while
    the object itself is whole. The load is refused, but the message says the chunk file
    "holds 12004 bytes, not 12004": TensorStore refuses the part quoting the object's
    total size, which `read_parts` takes for the size of a shorter value. The user is
    told to restore a checkpoint that is intact."""
    from conftest import CountingProxy, ObjectStore

    from eqxckpt._storage import _backend

    store = ObjectStore("s3", *s3)
    monkeypatch.setattr(_backend, "PART_BYTES", 1000)  # 13 parts of a 12004-byte chunk
    altered = []

    def alter(method, key, byte_range, status, body):
        if method == "GET" and "/w/c/0" in key and byte_range == "bytes=1000-1999" and not altered:
            altered.append(key)
            return status, body[:-10] if fault == "short" else body + bytes(10)
        return status, body

    proxy = CountingProxy(store.endpoint, delay=0.0, alter=alter)
    prefix = f"part-length-{fault}/"
    w = np.arange(3000, dtype=np.float32)
    try:
        eqxckpt.save(store.spec(prefix), {"w": w})
        with pytest.raises(eqxckpt.CorruptCheckpointError, match="Leaf 'w'") as refused:
            eqxckpt.load({**store.spec(prefix), "endpoint": proxy.endpoint})
        assert altered and proxy.active == 0
        assert "holds 12004 bytes, not 12004" not in str(refused.value), str(refused.value)
    finally:
        proxy.close()


def test_a_chunk_read_in_parts_within_a_small_budget_is_checked_whole(store):
    """With host_memory_budget=2 MiB, a 12 MiB chunk is downloaded as 2 MiB ranges, one at a
    time (not all at once): exact values, and a chunk object one byte shorter or longer, or
    with other bytes, is refused naming the leaf, whatever part shows it."""
    where = store.spec("runs/parts/")
    value = np.random.default_rng(0).standard_normal((3 << 20,)).astype(np.float32)
    eqxckpt.save(where, {"w": value})
    np.testing.assert_array_equal(eqxckpt.load(where, host_memory_budget=2 << 20)["w"], value)
    [chunk] = [k for k in store.keys("runs/parts/") if k.endswith("/w/c/0")]
    good = store.get(chunk)
    for bad, found in ((good[:-1], "holds 12582915 bytes"), (good + b"\0", "holds more than"), (good[::-1], "CRC")):
        store.put(chunk, bad)
        with pytest.raises(eqxckpt.CorruptCheckpointError, match=rf"Leaf 'w'.*{found}"):
            eqxckpt.load(where, host_memory_budget=2 << 20)
    store.put(chunk, good)
    np.testing.assert_array_equal(eqxckpt.load(where, host_memory_budget=2 << 20)["w"], value)


# The writer: a save in a thread, paused before its first chunk write until GO exists;
# its main thread then ends (pthread_exit), as when an embedding program's main thread
# returns while a worker thread goes on. The process is alive: its writer thread runs.
LIVE_WRITER = r"""
import ctypes, json, os, sys, threading, time
import numpy as np
import eqxckpt
from eqxckpt._storage import _backend

spec, ready, go, out = json.loads(sys.argv[1]), *sys.argv[2:5]
original = _backend.KvChunkFiles.writing

async def writing(self, key, pieces):
    if not os.path.exists(ready):
        open(ready, "w").close()
        while not os.path.exists(go):
            time.sleep(0.01)
    await original(self, key, pieces)

_backend.KvChunkFiles.writing = writing

def save():
    try:
        eqxckpt.save(spec, {"w": np.full((256, 256), 1.0, np.float32)}, overwrite=True)
        outcome = {"saved": True}
    except Exception as e:
        outcome = {"saved": False, "raised": type(e).__name__, "message": str(e)}
    with open(out, "w") as f:
        json.dump(outcome, f)
    os._exit(0)

threading.Thread(target=save).start()
while not os.path.exists(ready):
    time.sleep(0.01)
ctypes.CDLL(None).pthread_exit(None)  # the main thread ends; the process goes on
"""


def test_a_live_writer_whose_main_thread_ended_keeps_its_lease(tmp_path, s3):
    """Its process is alive though its thread-group leader is a zombie: `holder_is_gone`
    counts the process's threads, and the lease is not taken over (outside attack 10).
    S3 only: the takeover's refusal relies on a conditional write."""
    store = ObjectStore("s3", *s3)
    spec = store.spec(f"a10-lease-{tmp_path.name}/")
    ready, go, out = (str(tmp_path / name) for name in ("ready", "go", "out"))
    writer = subprocess.Popen(
        [sys.executable, "-c", LIVE_WRITER, json.dumps(spec), ready, go, out], env=dict(os.environ, JAX_PLATFORMS="cpu")
    )
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(ready):
            assert writer.poll() is None and time.monotonic() < deadline, "the writer did not start its save"
            time.sleep(0.02)
        time.sleep(0.5)  # its main thread has ended by now
        with open(f"/proc/{writer.pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        threads = os.listdir(f"/proc/{writer.pid}/task")
        assert state == "Z" and len(threads) > 1, (state, threads)  # alive, its leader a zombie
        # Another process saving to the same place must wait for the live save.
        try:
            eqxckpt.save(spec, {"w": np.full((256, 256), 2.0, np.float32)}, overwrite=True)
            ours = "saved"
        except eqxckpt.CheckpointBusyError:
            ours = "busy"
    finally:
        open(go, "w").close()
        writer.wait(120)
    with open(out) as f:
        theirs = json.load(f)
    restored = eqxckpt.load(spec)
    assert (ours, theirs["saved"]) == ("busy", True), (ours, theirs)
    assert np.asarray(restored["w"]).tolist() == np.full((256, 256), 1.0, np.float32).tolist()


@pytest.mark.parametrize("swap", ["other-save", "same-bytes"])
def test_a_chunk_replaced_between_groups_is_never_returned_as_a_mix(tmp_path, s3, monkeypatch, swap):
    """A 3 MiB leaf (one chunk) read with host_memory_budget=1: three groups of 1 MiB. Before
    the second group, its chunk object is replaced by the chunk of another save of the same
    leaf (valid on its own) or rewritten with its own bytes. The load returns the first
    save's values exactly, or refuses; never a mix."""
    store = ObjectStore("s3", *s3)
    prefix = f"a10-groups-{swap}-{tmp_path.name}/"
    first = np.arange(3 << 18, dtype=np.float32)
    second = -first - 1
    eqxckpt.save(store.spec(prefix + "a/"), {"w": first})
    eqxckpt.save(store.spec(prefix + "b/"), {"w": second})
    [chunk_a] = [k for k in store.keys(prefix + "a/") if "/w/c/" in k]
    [chunk_b] = [k for k in store.keys(prefix + "b/") if "/w/c/" in k]
    replacement = store.get(chunk_b if swap == "other-save" else chunk_a)
    original, starts = _backend.read_parts, []

    def read_parts(kv, key, size, part_bytes, start=0, stop=None):
        if key.endswith("w/c/0") and start > 0 and len(starts) == 1:
            store.client.put_object(Bucket=BUCKET, Key=chunk_a, Body=replacement)
        if key.endswith("w/c/0"):
            starts.append((start, stop))
        return original(kv, key, size, part_bytes, start, stop)

    monkeypatch.setattr(_backend, "read_parts", read_parts)
    try:
        restored = np.asarray(eqxckpt.load(store.spec(prefix + "a/"), host_memory_budget=1)["w"])
    except eqxckpt.CheckpointError as e:
        assert "w" in str(e) and "replaced" in str(e), e
        restored = None
    # Read in groups: 1 MiB, 1 MiB, 1 MiB, then its 4-byte checksum (stopped at the second if refused).
    assert starts[:2] == [(0, 1 << 20), (1 << 20, 2 << 20)], starts
    if restored is not None:
        assert restored.tobytes() == first.tobytes()


def test_the_run_identity_is_created_once_and_left_alone(store):
    run = eqxckpt._storage.resolve(store.spec("runs/identity/"))
    assert read_run_id(run, create=False) is None and store.keys("runs/identity/") == []
    run_id = read_run_id(run, create=True)
    assert run_id is not None and len(run_id) == 32 and int(run_id, 16) >= 0
    assert store.get(f"runs/identity/{RUN_NAME}") == run_identity_bytes(run_id)
    assert read_run_id(run, create=True) == read_run_id(run, create=False) == run_id
    with pytest.raises(eqxckpt.CheckpointNotFoundError, match="a CheckpointManager run with no committed step yet"):
        eqxckpt.load(store.spec("runs/identity/"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither the scan nor the cleanup says a word about it
        with eqxckpt.CheckpointManager(store.spec("runs/identity/"), max_to_keep=1) as manager:
            for step in range(3):
                manager.save(step, {"x": np.full(2, float(step))})
    assert {key.split("/")[2] for key in store.keys("runs/identity/")} == {"2", RUN_NAME}  # retention kept it
    scan = scan_steps(run)
    assert list(scan.committed) == [2] and scan.skipped == [] and scan.warning(run) is None
    assert clean_leftovers(run) is None and run.entries() == [("2", "committed")]
    assert store.get(f"runs/identity/{RUN_NAME}") == run_identity_bytes(run_id)
    assert cli(["verify", json.dumps(store.spec("runs/identity/"))]) == 0
    for key in store.keys("runs/identity/"):  # the run deleted: a new run, a new identity
        store.delete(key)
    assert read_run_id(run, create=False) is None
    renewed = read_run_id(run, create=True)
    assert renewed is not None and renewed != run_id


def test_a_run_identity_that_is_not_eqxckpts_is_refused_unread_past_its_cap(store):
    run = eqxckpt._storage.resolve(store.spec("runs/hostile-identity/"))
    key = f"runs/hostile-identity/{RUN_NAME}"
    for raw, found in [
        (b'{"run": "%s", "format": 1}' % (b"g" * 32), 'names the run "gggg'),
        (b'{"run": "%s"}' % (b"a" * 32), "holds the fields ['run']"),
        (b"{" + b" " * (64 << 20) + b"}", "holds more than 4096 bytes"),
    ]:
        store.put(key, raw)
        with pytest.raises(eqxckpt.ManifestError) as raised:
            read_run_id(run, create=True)
        assert str(raised.value).startswith(f"{store.url('runs/hostile-identity/')}{RUN_NAME} {found}")
        assert "Restore it from a copy of the run" in str(raised.value)
        assert store.get(key) == raw  # never rewritten


def create_run_id_after(barrier: threading.Barrier, where: dict) -> str | None:
    barrier.wait()
    return read_run_id(eqxckpt._storage.resolve(where), create=True)  # a storage of its own each


def test_creators_racing_on_s3_all_get_one_identity(s3):
    endpoint, _ = s3
    for attempt in range(5):
        where = spec(endpoint, f"runs/race-{attempt}/")
        barrier = threading.Barrier(6)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            found = list(pool.map(lambda _, b=barrier, w=where: create_run_id_after(b, w), range(6)))
        assert len(set(found)) == 1 and found[0] is not None
        assert read_run_id(eqxckpt._storage.resolve(where), create=False) == found[0]


def create_once_after(barrier: threading.Barrier, where: dict, raw: bytes) -> bool:
    barrier.wait()
    return eqxckpt._storage.resolve(where).create_once(RUN_NAME, raw)


def test_of_creators_racing_on_s3_exactly_one_writes(s3):
    endpoint, client = s3
    for attempt in range(5):
        where = spec(endpoint, f"runs/race-once-{attempt}/")
        barrier = threading.Barrier(6)
        raws = [run_identity_bytes(f"{i:032x}") for i in range(6)]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            created = list(pool.map(lambda raw, b=barrier, w=where: create_once_after(b, w, raw), raws))
        assert created.count(True) == 1  # the others' conditional writes failed
        stored = client.get_object(Bucket=BUCKET, Key=f"runs/race-once-{attempt}/{RUN_NAME}")["Body"].read()
        assert stored == raws[created.index(True)]


def test_steps_whose_base_another_tool_deleted_are_listed_unreadable_not_dropped(store):
    """#53 defect 3: steps 1 and 2 refer to step 0's prefix; another tool deletes `run/0/`.
    They were taken for deleted meanwhile: listed nowhere, no warning, `latest_step()` None
    and the trainer's next save refused. They are unreadable steps, named in a warning with
    the missing prefix, and loading one says what is gone."""
    top = f"vanished-base-{store.name}/"
    frozen = np.arange(20_000, dtype=np.float32)
    with eqxckpt.CheckpointManager(store.spec(top), kept_copies=1) as manager:
        for step in range(3):
            manager.save(step, {"frozen": frozen, "step": step})
            manager.wait()
    assert manifest_doc(store.get(f"{top}2/eqxckpt.json"))["leaves"][0]["arrays"].startswith("../0/%arrays.")
    for key in store.keys(f"{top}0/"):
        store.delete(key)
    with pytest.warns(
        UserWarning, match=r"1 \(CorruptCheckpointError: .* refers to unchanged leaves in \.\./0/%arrays"
    ):
        manager = eqxckpt.CheckpointManager(store.spec(top))
    with manager:
        assert manager.all_steps() == [] and manager.latest_step() is None
        with pytest.raises(eqxckpt.CheckpointExistsError, match="holds a checkpoint that cannot be read"):
            manager.save(1, {"frozen": frozen, "step": 1})
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="Restore that prefix from a copy"):
        eqxckpt.load(store.spec(f"{top}2"))


def test_a_live_holder_in_another_pid_namespace_is_never_judged_dead(tmp_path):
    """#53 defect 4: a lease holder in a container (``unshare --pid --mount-proc``), checked
    from a process that entered its pid namespace but kept the host's /proc: the holder's
    pid was looked up in the host's numbering, and the live holder's lease taken over.
    There the answer is "cannot tell" (only the lease's clock decides)."""
    token = f"eqxckpt-holder-{os.getpid()}-{time.monotonic_ns()}"
    code = (
        "import json, os, sys, time; from eqxckpt._storage._lease import _holder; "
        "print(json.dumps({**_holder(), 'pid': os.getpid()}), flush=True); time.sleep(120)"
    )
    try:
        holder = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code, token],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    except FileNotFoundError:
        pytest.skip("no unshare here")
    try:
        line = holder.stdout.readline() if holder.stdout else ""
        if not line:
            pytest.skip(f"cannot make a pid namespace here: {holder.stderr.read() if holder.stderr else ''}")
        doc = json.loads(line)
        assert doc["pid_namespace"] and doc["pid"] <= 3  # its own namespace's numbering

        def runs_holder(entry: pathlib.Path) -> bool:
            try:
                return (
                    token.encode() in (entry / "cmdline").read_bytes() and "unshare" not in (entry / "comm").read_text()
                )
            except OSError:  # gone meanwhile
                return False

        [host_pid] = [p.name for p in pathlib.Path("/proc").iterdir() if p.name.isdigit() and runs_holder(p)]
        check = f"import json; from eqxckpt._storage._lease import holder_is_gone; print(holder_is_gone({doc!r}))"
        entered = subprocess.run(
            ["nsenter", f"--pid=/proc/{host_pid}/ns/pid", sys.executable, "-c", check],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert entered.returncode == 0, entered.stderr
        assert entered.stdout.strip() == "False"  # not "gone": the holder is alive
        assert not holder_is_gone(doc)  # from the host's namespace: another namespace, cannot tell
    finally:
        holder.kill()
        holder.wait()


def test_retention_on_an_object_store_leaves_a_users_keys_inside_a_step(store):
    """What docs/concurrency.md says of object stores: only keys eqxckpt wrote are deleted;
    a user's object inside a step's prefix stays where it is."""
    top = f"users-keys-{store.name}-{time.monotonic_ns()}/"
    with eqxckpt.CheckpointManager(store.spec(top), max_to_keep=1) as manager:
        manager.save(0, {"w": np.arange(4.0)})
        manager.wait()
        store.put(f"{top}0/notes.txt", b"mine")
        manager.save(1, {"w": np.arange(4.0) + 1})
        manager.wait()
        assert manager.all_steps() == [1]
    assert store.get(f"{top}0/notes.txt") == b"mine"


def test_retention_leaves_a_users_key_inside_a_steps_own_prefix(store):
    """Found by the fault harness's foreign-tool rule: a user's key put inside a step's own
    ``%arrays.<hex>/`` prefix (beside a leaf's chunks) was deleted with the step, as the
    whole prefix was. Only the keys eqxckpt writes there are deleted; the user's stays."""
    top = f"users-key-{store.name}/run/"
    with eqxckpt.CheckpointManager(store.spec(top), max_to_keep=1, blocking=True, incremental=False) as manager:
        manager.save(0, {"w": np.arange(1000.0)})
        [chunk] = [k for k in store.keys(f"{top}0/") if k.endswith("/w/c/0")]
        mine = chunk.replace("/w/c/0", "/w/notes.txt")
        store.put(mine, b"mine")
        manager.save(1, {"w": np.arange(1000.0) + 1})
    assert manager.all_steps() == [1] and store.get(mine) == b"mine"
    assert [k for k in store.keys(f"{top}0/")] == [mine]  # the step's own keys are gone
