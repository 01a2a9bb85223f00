"""The storage layer (`_storage`): resolving paths, atomic exchange, and object-store
saves that never clear what eqxckpt did not write."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

import eqxckpt
from eqxckpt._read._checkpoint import open_checkpoint
from eqxckpt._storage import BufferStorage, resolve
from eqxckpt._storage._fs import exchange


def test_resolve_forms(tmp_path, monkeypatch):
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID"):
        monkeypatch.delenv(name, raising=False)
    local = resolve(tmp_path / "c")
    assert local.local == tmp_path / "c" and local.kvstore == {"driver": "file", "path": f"{tmp_path}/c/"}
    assert resolve(f"file://{tmp_path}/c").local == tmp_path / "c"
    s3 = resolve("s3://bucket/run/step_1")
    assert s3.local is None and s3.kvstore == {"driver": "s3", "bucket": "bucket", "path": "run/step_1/"}
    assert resolve("gs://b/x").kvstore == {"driver": "gcs", "bucket": "b", "path": "x/"}
    assert resolve("memory://a/b").kvstore == {"driver": "memory", "path": "a/b/"}
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    assert resolve("s3://b/p").kvstore == {
        "driver": "s3",
        "bucket": "b",
        "path": "p/",
        "endpoint": "http://127.0.0.1:9",
        "aws_credentials": {"type": "environment"},
    }
    spec = resolve({"driver": "s3", "bucket": "b", "path": "p", "endpoint": "http://127.0.0.1:9"})
    assert spec.kvstore["endpoint"] == "http://127.0.0.1:9" and spec.kvstore["path"] == "p/"
    assert s3.child("model/w") == {"driver": "s3", "bucket": "bucket", "path": "run/step_1/model/w/"}
    with pytest.raises(eqxckpt.ManifestError):
        s3.child("../other")
    with pytest.raises(eqxckpt.CheckpointError, match="scheme"):
        resolve("ftp://x/y")


def test_exchange_swaps_atomically(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "x").write_text("old")
    (b / "y").write_text("new")
    if exchange(a, b):
        assert (a / "y").read_text() == "new" and (b / "x").read_text() == "old"
    else:  # unsupported here: nothing may have moved (save then falls back to two renames)
        assert (a / "x").read_text() == "old" and (b / "y").read_text() == "new"


def test_object_store_overwrite_never_clears_foreign_data():
    import tensorstore as ts

    from eqxckpt._tensorstore import shared_context

    store = ts.KvStore.open({"driver": "memory", "path": "foreign/"}, context=shared_context()).result()
    store.write("notes.txt", b"precious").result()
    with pytest.raises(eqxckpt.CheckpointExistsError, match="not an eqxckpt checkpoint"):
        eqxckpt.save("memory://foreign", {"a": np.ones(2)}, overwrite=True)
    assert store.read("notes.txt").result().value == b"precious"
    # A save's prefix that neither a manifest nor a lease names, and that eqxckpt never
    # retired, is refused on load; a new save there writes beside it and leaves it alone
    # (a copy of a checkpoint, its prefix copied before its manifest, looks the same).
    eqxckpt.save("memory://half", {"a": np.ones(2), "b": np.ones(3)})
    half = ts.KvStore.open({"driver": "memory", "path": "half/"}, context=shared_context()).result()
    half.delete_range(ts.KvStore.KeyRange("eqxckpt.json", "eqxckpt.json\0")).result()
    [dead] = {key.split(b"/")[0] for key in half.list().result()}
    copied = sorted(half.list().result())
    with pytest.raises(eqxckpt.IncompleteCheckpointError):
        eqxckpt.load("memory://half")
    eqxckpt.save("memory://half", {"a": np.zeros(2)})
    assert eqxckpt.open("memory://half").paths == ["a"]
    assert sorted(key for key in half.list().result() if key.startswith(dead)) == copied
    # Arrays beside the manifest's place with neither a manifest nor a lease: nothing
    # proves that eqxckpt wrote them, so a save is refused...
    legacy = ts.KvStore.open({"driver": "memory", "path": "legacy/"}, context=shared_context()).result()
    for key in ("a/zarr.json", "a/c/0", "b/zarr.json", "b/c/0", "zarr.json"):
        legacy.write(key, b"{}").result()
    with pytest.raises(eqxckpt.CheckpointExistsError, match="did not write"):
        eqxckpt.save("memory://legacy", {"a": np.zeros(2)})
    assert len(legacy.list().result()) == 5
    # ...unless an abandoned lease of an eqxckpt from before prefixes lists them: reclaimed.
    legacy.write(
        "eqxckpt.lease.json",
        json.dumps(
            {
                "format": "eqxckpt-lease",
                "purpose": "save",
                "heartbeat_unix": 0.0,
                "timeout_s": 1.0,
                "paths": ["a", "b"],
            }
        ),
    ).result()
    eqxckpt.save("memory://legacy", {"a": np.zeros(2)})
    assert eqxckpt.open("memory://legacy").paths == ["a"]
    left = sorted(key.decode() for key in legacy.list().result())
    # (the root zarr.json written above is not what eqxckpt writes there, so it stays)
    assert [key for key in left if not key.startswith("%arrays.")] == ["eqxckpt.json", "zarr.json"]


def test_a_save_syncs_through_a_descriptor_opened_before_its_writes(tmp_path, monkeypatch):
    """`syncfs` reports the write errors since its descriptor was opened: a save syncs
    through its staging directory's lock, opened before its first chunk was written,
    and leaves that descriptor open (the lock is released after the commit)."""
    import os

    import eqxckpt._storage._disk as local

    used = []
    real = local.sync_filesystem

    def recording(root, opened=None):
        used.append((opened, os.fstat(opened).st_ino if opened is not None else None, root.stat().st_ino))
        real(root, opened)
        os.fstat(opened)  # still open: never closed by the sync

    monkeypatch.setattr(local, "sync_filesystem", recording)
    eqxckpt.save(tmp_path / "c", {"x": np.arange(8)})
    [(opened, fd_inode, root_inode)] = used
    assert opened is not None and fd_inode == root_inode  # the staging directory itself
    np.testing.assert_array_equal(eqxckpt.load(tmp_path / "c")["x"], np.arange(8))


# Leaf metadata is read on threads of its own: after a fork, and at exit.
METADATA_PRELUDE = """
import atexit, os, signal, sys, time, warnings
import numpy as np
import eqxckpt
warnings.simplefilter("ignore")
where = sys.argv[1]
tree = {"a": np.arange(50000.0, dtype=np.float32), "b": np.ones(30000, np.float32)}
like = {k: np.zeros_like(v) for k, v in tree.items()}
eqxckpt.save(where, tree)
def check():
    got = eqxckpt.load(where, like=like)
    return all(np.array_equal(got[k], tree[k]) for k in tree)
"""


def run_loading(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = METADATA_PRELUDE + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "c")], capture_output=True, text=True, timeout=120
    )


@pytest.mark.multiprocess
def test_a_child_forked_after_a_load_loads(tmp_path):
    # The parent's metadata threads are not in the child: a pool made before the fork
    # would take the child's work and never run it (the load waited for ever).
    done = run_loading(
        tmp_path,
        """
        print("parent", check(), flush=True)
        for _ in range(3):
            time.sleep(0.2)
            pid = os.fork()
            if pid == 0:
                signal.alarm(30)
                print("child", check(), flush=True)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            print("status", os.waitstatus_to_exitcode(status), flush=True)
        """,
    )
    assert done.stdout.splitlines() == ["parent True"] + ["child True", "status 0"] * 3, done.stderr


@pytest.mark.multiprocess
def test_a_load_at_exit_loads(tmp_path):
    # atexit handlers run after concurrent.futures stopped taking work at shutdown.
    done = run_loading(tmp_path, 'atexit.register(lambda: print("at exit", check(), flush=True))\n')
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["at exit True"], done.stderr


def test_a_zarr_json_that_is_a_directory_is_named_by_its_path(tmp_path):
    # A directory opened as a file object failed naming its descriptor ("Is a directory: 5").
    eqxckpt.save(tmp_path / "c", {"w": np.ones(3)})
    zarr_json = tmp_path / "c" / "w" / "zarr.json"
    zarr_json.unlink()
    zarr_json.mkdir()
    with pytest.raises(eqxckpt.CorruptCheckpointError) as caught:
        eqxckpt.load(tmp_path / "c")
    assert "not a regular file" in str(caught.value) and str(zarr_json) in str(caught.value)
    assert caught.value.leaf_path == "w"


def test_a_checkpoint_replaced_while_its_manifest_is_opened_is_changed_not_incomplete(tmp_path, monkeypatch):
    # The window the overwrite race test hit once in CI: the reader holds the old directory
    # open, the overwrite moves it aside and removes its manifest before the reader reads it.
    import eqxckpt._storage._disk as local_storage

    eqxckpt.save(tmp_path / "c", {"x": np.arange(3)})
    real_read = local_storage.read_capped

    def overwritten_first(name, limit, *, dir_fd):
        os.rename(tmp_path / "c", tmp_path / "aside")
        os.unlink(tmp_path / "aside" / "eqxckpt.json")
        eqxckpt.save(tmp_path / "c", {"x": np.arange(3) + 1})
        monkeypatch.setattr(local_storage, "read_capped", real_read)
        return real_read(name, limit, dir_fd=dir_fd)

    monkeypatch.setattr(local_storage, "read_capped", overwritten_first)
    with pytest.raises(eqxckpt.CheckpointChangedError, match="replaced or deleted"):
        eqxckpt.open(tmp_path / "c")
    # `load` reads a changed checkpoint again, and gets the new one whole.
    shutil.rmtree(tmp_path / "aside")
    eqxckpt.save(tmp_path / "c", {"x": np.arange(3)}, overwrite=True)
    monkeypatch.setattr(local_storage, "read_capped", overwritten_first)
    assert eqxckpt.load(tmp_path / "c")["x"].tolist() == [1, 2, 3]
    # Unmoved and without a manifest, it is still an uncommitted save.
    os.unlink(tmp_path / "c" / "eqxckpt.json")
    with pytest.raises(eqxckpt.IncompleteCheckpointError):
        eqxckpt.load(tmp_path / "c")


# -- a checkpoint held as its files' bytes (`BufferStorage`) ----------------------------------


def _files_of(path) -> dict[str, np.ndarray]:
    return {str(f.relative_to(path)): np.fromfile(f, np.uint8) for f in sorted(path.rglob("*")) if f.is_file()}


@settings(max_examples=20, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(0, 5), max_size=3).map(tuple), min_size=1, max_size=4),
    dtype=st.sampled_from([np.float32, np.int8, np.complex64, np.bool_]),
)
def test_a_checkpoint_read_from_its_files_bytes_loads_as_from_disk(tmp_path_factory, shapes, dtype):
    path = tmp_path_factory.mktemp("held") / "c"
    rng = np.random.default_rng(len(shapes))
    tree = {f"l{i}": rng.integers(0, 100, shape).astype(dtype) for i, shape in enumerate(shapes)}
    eqxckpt.save(path, {**tree, "n": 3})
    held = BufferStorage.of(_files_of(path), "a copy")
    loaded = eqxckpt.load(open_checkpoint(held))
    assert loaded["n"] == 3 and loaded.keys() == {*tree, "n"}
    for name, value in tree.items():
        assert loaded[name].dtype == value.dtype and np.array_equal(loaded[name], value)


def test_a_held_checkpoint_with_damaged_or_missing_files_is_refused_naming_the_leaf(tmp_path):
    eqxckpt.save(tmp_path / "c", {"w": np.arange(4096, dtype=np.float32), "v": np.ones(3)})
    files = _files_of(tmp_path / "c")
    [chunk] = [key for key in files if key.startswith("w/c/")]
    flipped = files[chunk].copy()
    flipped[7] ^= 1
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="'w'"):
        eqxckpt.load(open_checkpoint(BufferStorage.of({**files, chunk: flipped}, "a copy")))
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="'w'"):  # refused before any allocation
        eqxckpt.load(open_checkpoint(BufferStorage.of({k: d for k, d in files.items() if k != chunk}, "a copy")))
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="'w'"):
        eqxckpt.load(
            open_checkpoint(BufferStorage.of({**files, chunk: files[chunk][:-1], "w/c/x": files[chunk][:8]}, "a copy"))
        )
    with pytest.raises(eqxckpt.CheckpointNotFoundError, match="a copy"):
        eqxckpt.load(
            open_checkpoint(BufferStorage.of({k: d for k, d in files.items() if k != "eqxckpt.json"}, "a copy"))
        )
    import eqxckpt._storage._buffers as buffers_module

    with pytest.MonkeyPatch.context() as patch:  # an oversized manifest: as the disk says it
        patch.setattr(buffers_module, "MAX_MANIFEST_BYTES", 64)
        with pytest.raises(eqxckpt.ManifestError, match="over the 64-byte limit"):
            eqxckpt.load(open_checkpoint(BufferStorage.of(files, "a copy")))
    held = BufferStorage.of(files, "a copy")
    with pytest.raises(eqxckpt.CheckpointError, match="read only"):
        held.begin_save(["w"], overwrite=True)
    assert np.array_equal(eqxckpt.load(open_checkpoint(held))["w"], np.arange(4096, dtype=np.float32))
