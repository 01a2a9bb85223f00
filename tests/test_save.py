import collections
import functools
import json
import os
import pathlib
import subprocess
import sys
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from conftest import assert_trees_equal, manifest_doc
from hypothesis import HealthCheck, given, settings, strategies as st

import eqxckpt
from eqxckpt._errors import CheckpointError, CheckpointExistsError
from eqxckpt._write._pack import PACK_MAX_BYTES, PACK_MIN_LEAVES

NUMPY_DTYPES = [
    np.float16,
    np.float32,
    np.float64,
    ml_dtypes.bfloat16,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.bool_,
    np.complex64,
    np.complex128,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
    ml_dtypes.int4,
]


def _sample(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind == "c":
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dtype)
    if dtype.name == "int4":
        return rng.integers(-8, 7, shape, endpoint=True).astype(dtype)
    if dtype.kind in "iu":
        return rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, shape, dtype=dtype, endpoint=True)
    return (rng.standard_normal(shape) * 10).astype(dtype)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=lambda d: np.dtype(d).name)
def test_every_dtype_round_trips_bit_exact(tmp_path, dtype):
    tree = {"x": _sample(dtype, (3, 5)), "scalar0d": _sample(dtype, ()), "empty": _sample(dtype, (0, 4))}
    if jnp.asarray(tree["x"]).dtype == tree["x"].dtype:  # jax holds it without x64
        tree["jax"] = jnp.asarray(tree["x"])
    eqxckpt.save(tmp_path / "c", tree)
    assert_trees_equal(eqxckpt.load(tmp_path / "c", tree), tree)
    zarr = json.loads((tmp_path / "c" / "x" / "zarr.json").read_text())
    assert zarr["data_type"] == np.dtype(dtype).name
    assert {"name": "crc32c"} in zarr["codecs"]


def test_nan_and_special_floats_are_bit_exact(tmp_path):
    x = np.array([np.nan, -0.0, np.inf, -np.inf, 1e-45], np.float32)
    x.view(np.uint32)[0] = 0x7FC00001  # a NaN with a payload
    eqxckpt.save(
        tmp_path / "c", {"x": x, "py": [float("nan"), float("-inf"), -0.0, 1e308, 2**70, 1 + 2j, True, None, "ünï"]}
    )
    out = eqxckpt.load(tmp_path / "c", {"x": x, "py": [0.0, 0.0, 0.0, 0.0, 0, 0j, False, None, ""]})
    assert out["x"].tobytes() == x.tobytes()
    py = out["py"]
    assert py[0] != py[0] and py[1] == float("-inf") and str(py[2]) == "-0.0"
    assert py[3:] == [1e308, 2**70, 1 + 2j, True, None, "ünï"] and type(py[4]) is int


class Opt(collections.namedtuple("Opt", "a b")):
    pass


def _training_state():
    model, state = eqx.nn.make_with_state(
        lambda key: eqx.nn.Sequential(
            [eqx.nn.Linear(3, 4, key=key), eqx.nn.BatchNorm(4, "batch", mode="ema"), eqx.nn.Lambda(jax.nn.relu)]
        )
    )(jax.random.key(0))
    mlp = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(1))
    params = eqx.filter(mlp, eqx.is_array)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    return {
        "model": mlp,
        "seq": model,
        "bn_state": state,
        "opt_state": opt.init(params),
        "sgd": optax.sgd(0.1).init(params),  # EmptyState-bearing
        "named": Opt(jnp.arange(3), np.ones(2, np.float32)),
        "key": jax.random.key(42),
        "rbg_keys": jax.random.split(jax.random.key(1, impl="rbg"), 3),
        "raw_key": jax.random.PRNGKey(5),
        "step": 17,
        "lr": 3e-4,
        "name": "run-1",
        "empty": {"l": [], "t": (), "d": {}},
        "none": None,
        "fn": jax.nn.gelu,
    }


def test_equinox_and_optax_state_round_trips(tmp_path):
    tree = _training_state()
    eqxckpt.save(tmp_path / "c", tree, metadata={"step": 17, "config": {"width": 8}})
    assert_trees_equal(eqxckpt.load(tmp_path / "c", tree), tree)
    skeleton = eqx.filter_eval_shape(_training_state)
    assert_trees_equal(eqxckpt.load(tmp_path / "c", skeleton), tree)
    restored = eqxckpt.load(tmp_path / "c", _training_state)
    assert_trees_equal(restored, tree)
    assert restored["fn"] is jax.nn.gelu  # functions come from `like`
    # the restored model runs and the BatchNorm state is usable
    run = jax.vmap(restored["seq"], axis_name="batch", in_axes=(0, None), out_axes=(0, None))
    out, new_state = run(jnp.ones((5, 3)), restored["bn_state"])
    assert out.shape == (5, 4) and jax.tree_util.tree_structure(new_state) == jax.tree_util.tree_structure(
        tree["bn_state"]
    )


def test_directory_tree_is_readable(tmp_path):
    eqxckpt.save(tmp_path / "c", _training_state())
    nodes = {
        str(p.parent.relative_to(tmp_path / "c")): json.loads(p.read_text())["node_type"]
        for p in (tmp_path / "c").rglob("zarr.json")
    }
    stored = sorted(path for path, node in nodes.items() if node == "array")
    groups = sorted(path for path, node in nodes.items() if node == "group")
    # The root and every directory above an array are zarr groups, so zarr tools browse the hierarchy.
    assert groups == sorted(
        {"."}
        | {str(pathlib.Path(path).parent) for path in stored} - {"."}
        | {str(parent) for path in stored for parent in pathlib.Path(path).parents if str(parent) != "."}
    )
    assert "model/layers/0/weight" in stored and "model/layers/1/bias" in stored
    assert "opt_state/1/0/mu/layers/0/weight" in stored  # chain -> adamw -> ScaleByAdamState.mu
    assert "key" in stored and "bn_state/0" in stored
    manifest = manifest_doc((tmp_path / "c" / "eqxckpt.json").read_text())
    assert manifest["format"] == "eqxckpt" and manifest["version"] == 5
    kinds = {leaf["path"]: leaf["kind"] for leaf in manifest["leaves"]}
    assert kinds["step"] == "scalar" and kinds["fn"] == "opaque" and kinds["key"] == "prng_key"
    assert kinds["model/activation"] == "opaque"
    # the raw uint32 key is an ordinary array
    assert kinds["raw_key"] == "array"
    assert len(stored) == sum(k in ("array", "prng_key") for k in kinds.values())


def test_no_temporary_directories_left(tmp_path):
    eqxckpt.save(tmp_path / "c", {"a": np.ones(3)})
    eqxckpt.save(tmp_path / "c", {"a": np.zeros(3)}, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_overwrite_false_refuses_and_keeps_old(tmp_path):
    eqxckpt.save(tmp_path / "c", {"a": np.ones(3)})
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        eqxckpt.save(tmp_path / "c", {"a": np.zeros(3)})
    np.testing.assert_array_equal(eqxckpt.load(tmp_path / "c")["a"], np.ones(3))


def test_overwrite_replaces(tmp_path):
    eqxckpt.save(tmp_path / "c", {"a": np.ones(3), "gone": np.ones(2)})
    eqxckpt.save(tmp_path / "c", {"a": np.zeros(3)}, overwrite=True)
    assert eqxckpt.open(tmp_path / "c").paths == ["a"]
    np.testing.assert_array_equal(eqxckpt.load(tmp_path / "c")["a"], np.zeros(3))
    assert not (tmp_path / "c" / "gone").exists()


def test_overwrite_never_deletes_a_foreign_directory(tmp_path):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "thesis.tex").write_text("precious")
    with pytest.raises(CheckpointExistsError, match="not an eqxckpt checkpoint"):
        eqxckpt.save(tmp_path / "c", {"a": np.ones(3)}, overwrite=True)
    assert (tmp_path / "c" / "thesis.tex").read_text() == "precious"


def test_failed_save_leaves_previous_intact(tmp_path):
    eqxckpt.save(tmp_path / "c", {"a": np.ones(3)})

    bad = {"a": np.zeros(3), "b": jnp.ones(2)}
    # a leaf that fails while being written: an unsupported dtype is refused up front...
    with pytest.raises(CheckpointError, match="float6_e2m3fn"):
        eqxckpt.save(tmp_path / "c", {"a": np.zeros(3, ml_dtypes.float6_e2m3fn)}, overwrite=True)
    # ...and a failure in the middle of writing removes the temporary directory
    import eqxckpt._write._save as save_module

    real = save_module._write

    def failing(target, leaves, **what):
        real(target, leaves[:1], **what)
        if what["chunks"]:
            raise OSError(28, "No space left on device")

    save_module._write = failing
    try:
        with pytest.raises(eqxckpt.CheckpointWriteError, match="No space"):
            eqxckpt.save(tmp_path / "c", bad, overwrite=True)
    finally:
        save_module._write = real
    np.testing.assert_array_equal(eqxckpt.load(tmp_path / "c")["a"], np.ones(3))
    assert sorted(os.listdir(tmp_path)) == ["c"]


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("count", [3, PACK_MIN_LEAVES + 5])  # own arrays, and packed leaves
def test_a_failure_while_hashing_during_the_writes_commits_nothing(tmp_path, monkeypatch, blocking, count):
    """Without a base the digests are computed while the chunks are written: a failure
    there must still abort the save before its commit, and keep what was there."""
    import eqxckpt._write._jobs as jobs_module

    old = {f"x{i}": np.full(4, i, np.float32) for i in range(count)}
    eqxckpt.save(tmp_path / "c", old)
    real = jobs_module.digest
    hashed = []

    def failing(fields, data):
        hashed.append(1)
        if len(hashed) == count - 1:
            raise MemoryError("out of memory while hashing")
        return real(fields, data)

    monkeypatch.setattr(jobs_module, "digest", failing)
    new = {f"x{i}": np.full(4, -i, np.float32) for i in range(count)}
    with pytest.raises(eqxckpt.CheckpointWriteError, match="Hashing leaf 'x.*out of memory"):
        eqxckpt.save(tmp_path / "c", new, overwrite=True, blocking=blocking).wait()
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert_trees_equal(eqxckpt.load(tmp_path / "c"), old)
    assert eqxckpt.verify(tmp_path / "c").ok
    monkeypatch.setattr(jobs_module, "digest", real)
    eqxckpt.save(tmp_path / "c", new, overwrite=True).wait()  # and the next save commits
    assert_trees_equal(eqxckpt.load(tmp_path / "c"), new)
    assert eqxckpt.verify(tmp_path / "c").ok


def test_a_failed_save_stops_hashing_its_leaves(tmp_path, monkeypatch):
    """A save whose writes fail returns once its hashing thread stopped (after the batch
    in hand), not after hashing the rest of the tree, and leaves no thread behind."""
    import eqxckpt._write._jobs as jobs_module
    import eqxckpt._write._save as save_module

    tree = {f"x{i:02d}": np.full(1 << 18, i, np.float32) for i in range(64)}  # 64 MiB: four batches
    started = []
    hashed = []
    real_digest, real_write, real_hashing = jobs_module.digest, save_module._write, save_module.Hashing

    class Hashing(real_hashing):
        def __init__(self, *args):
            started.append(self)
            super().__init__(*args)

    def digest(fields, data):
        started[0].stopping.wait(60)  # hashing is slow: the save fails first
        hashed.append(1)
        return real_digest(fields, data)

    def write(target, leaves, **what):
        if what["chunks"]:
            raise OSError(28, "No space left on device")
        real_write(target, leaves, **what)

    monkeypatch.setattr(save_module, "Hashing", Hashing)
    monkeypatch.setattr(jobs_module, "digest", digest)
    monkeypatch.setattr(save_module, "_write", write)
    with pytest.raises(eqxckpt.CheckpointWriteError, match="No space"):
        eqxckpt.save(tmp_path / "c", tree)
    count = len(hashed)
    assert 0 < count <= 32, count  # at most one batch of 16 leaves per hashing thread
    assert not [t for t in threading.enumerate() if t.name == "eqxckpt-hashing"]
    assert len(hashed) == count and not (tmp_path / "c").exists()


def test_all_writes_are_issued_before_any_is_awaited(tmp_path, monkeypatch):
    """Writes run concurrently: as many leaves' chunks as there are I/O threads are being
    written at once (each write waits until all are in flight; written one at a time, the
    barrier breaks)."""
    from eqxckpt._storage._disk_chunks import LocalChunkFiles
    from eqxckpt._window import IO_THREADS

    together = threading.Barrier(IO_THREADS, timeout=60)
    real_write = LocalChunkFiles.write

    def write(self, key, pieces):
        if key.endswith("/c/0"):
            together.wait()
        real_write(self, key, pieces)

    monkeypatch.setattr(LocalChunkFiles, "write", write)
    eqxckpt.save(tmp_path / "c", {f"w{i}": np.full((64,), i) for i in range(IO_THREADS)})
    monkeypatch.undo()
    assert eqxckpt.load(tmp_path / "c")["w7"][0] == 7


def test_metadata_must_be_json(tmp_path):
    with pytest.raises(CheckpointError, match="JSON"):
        eqxckpt.save(tmp_path / "c", {"a": 1}, metadata={"f": object()})
    assert not (tmp_path / "c").exists()


def test_bare_leaf_needs_a_container(tmp_path):
    with pytest.raises(CheckpointError, match="container"):
        eqxckpt.save(tmp_path / "c", np.ones(3))


def test_large_array_is_chunked(tmp_path, monkeypatch):
    import eqxckpt._chunks as chunks_module

    monkeypatch.setattr(chunks_module, "CHUNK_BYTES", 1024)
    x = np.arange(64 * 40, dtype=np.float32).reshape(64, 40)
    eqxckpt.save(tmp_path / "c", {"x": x})
    zarr = json.loads((tmp_path / "c/x/zarr.json").read_text())
    assert zarr["chunk_grid"]["configuration"]["chunk_shape"] == [6, 40]  # 6*40*4 <= 1024
    assert len(list((tmp_path / "c/x/c").rglob("*"))) > 10
    np.testing.assert_array_equal(eqxckpt.load(tmp_path / "c", {"x": x})["x"], x)


def test_async_save_snapshots_before_returning(tmp_path):
    x = np.arange(1000.0)
    handle = eqxckpt.save(tmp_path / "c", {"x": x}, blocking=False)
    x[:] = -1  # the caller reuses its buffer right away
    handle.wait()
    assert handle.done()
    np.testing.assert_array_equal(eqxckpt.load(tmp_path / "c")["x"], np.arange(1000.0))


def test_async_save_keeps_values_of_donated_and_deleted_buffers(tmp_path):
    model = eqx.nn.MLP(64, 64, 1024, 3, key=jax.random.key(0))
    params = eqx.filter(model, eqx.is_array)
    expected = jax.tree_util.tree_map(np.array, params)
    big = jnp.full((2048, 2048), 3.0)  # 16 MiB, so the background write outlasts the next step
    step = jax.jit(lambda p: jax.tree_util.tree_map(lambda x: -x - 1, p), donate_argnums=0)

    # Hold the background thread, so the step and the deletion below certainly
    # run while the save still needs the buffers (deterministic on a busy machine).
    gate = threading.Event()
    eqxckpt._write._background.SAVES.executor().submit(gate.wait)
    handle = eqxckpt.save(tmp_path / "c", {"params": params, "big": big}, blocking=False)
    new_params = step(params)  # the training step donates the saved buffers
    big.delete()
    assert not handle.done()
    gate.set()
    handle.wait()

    restored = eqxckpt.load(tmp_path / "c", {"params": expected, "big": np.zeros((2048, 2048), np.float32)})
    assert_trees_equal(restored["params"], expected)
    np.testing.assert_array_equal(restored["big"], np.full((2048, 2048), 3.0, np.float32))
    assert not np.array_equal(jax.tree_util.tree_leaves(new_params)[0], jax.tree_util.tree_leaves(expected)[0])


def test_async_snapshot_copies_numpy_leaves_only(tmp_path):
    """CPU jax arrays are held, not copied (immutable; the view keeps donated
    buffers alive); numpy arrays may be mutated later, so they are copied."""
    import tracemalloc

    x = jnp.ones((2048, 2048), jnp.float32)  # 16 MiB
    n = np.ones((2048, 2048), np.float32)
    tracemalloc.start()
    try:
        eqxckpt.save(tmp_path / "a", {"x": x}, blocking=False).wait()
        jax_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        handle = eqxckpt.save(tmp_path / "b", {"n": n}, blocking=False)
        n[:] = 7  # the caller reuses its buffer at once
        handle.wait()
        numpy_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        eqxckpt.save(tmp_path / "c", {"x": x, "n": n})
        blocking_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert jax_peak < 0.1 * x.nbytes
    assert n.nbytes <= numpy_peak < 1.1 * n.nbytes
    assert blocking_peak < 0.1 * x.nbytes
    np.testing.assert_array_equal(eqxckpt.load(tmp_path / "b")["n"], np.ones((2048, 2048), np.float32))


@pytest.mark.multiprocess
def test_background_failure_surfaces_on_wait_next_save_and_exit(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    # The target's parent is a file: only the background write discovers that.
    handle = eqxckpt.save(tmp_path / "file" / "ckpt", {"x": np.ones(3)}, blocking=False)
    with pytest.raises(eqxckpt.CheckpointWriteError):
        handle.wait()
    eqxckpt.save(tmp_path / "ok", {"x": np.ones(3)})  # an observed failure is not raised again

    eqxckpt.save(tmp_path / "file" / "ckpt2", {"x": np.ones(3)}, blocking=False)  # fails, never waited on
    with pytest.raises(CheckpointError, match="earlier background save to .*ckpt2 failed"):
        eqxckpt.save(tmp_path / "next", {"x": np.ones(3)}, blocking=False)
    assert not (tmp_path / "next").exists()
    eqxckpt.save(tmp_path / "next", {"x": np.ones(3)})  # reported once, then saving goes on

    script = f"""
import numpy as np, eqxckpt
eqxckpt.save({str(tmp_path / "file" / "ckpt3")!r}, {{"x": np.ones(3)}}, blocking=False)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "eqxckpt: background save to" in result.stderr and "ckpt3 failed" in result.stderr, result.stderr
    assert result.returncode == 1  # the script "succeeded", but its checkpoint was not written
    ok = subprocess.run(
        [sys.executable, "-c", script.replace(str(tmp_path / "file" / "ckpt3"), str(tmp_path / "fine"))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0 and (tmp_path / "fine/eqxckpt.json").exists(), ok.stderr


def test_saves_to_one_place_run_in_order(tmp_path):
    handles = [
        eqxckpt.save(tmp_path / "c", {"x": np.full(1000, float(i))}, blocking=False, overwrite=True, metadata={"i": i})
        for i in range(4)
    ]
    handles[-1].wait()
    assert all(h.done() for h in handles)
    assert eqxckpt.open(tmp_path / "c").metadata == {"i": 3}
    np.testing.assert_array_equal(eqxckpt.load(tmp_path / "c")["x"], np.full(1000, 3.0))


def test_memory_store(tmp_path):
    tree = {"a": jnp.arange(4), "b": {"c": np.ones((2, 2), np.float16)}, "s": 3}
    eqxckpt.save("memory://run/ckpt", tree)
    assert_trees_equal(eqxckpt.load("memory://run/ckpt", tree), tree)
    with pytest.raises(CheckpointExistsError):
        eqxckpt.save("memory://run/ckpt", tree)


leaf_arrays = st.builds(
    lambda dtype, shape, seed: _sample(dtype, shape, seed),
    st.sampled_from([np.float32, np.int64, np.uint8, np.bool_, ml_dtypes.bfloat16, np.complex64]),
    st.lists(st.integers(0, 4), max_size=3).map(tuple),
    st.integers(0, 1000),
)
trees = st.recursive(
    st.one_of(leaf_arrays, st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=8), st.booleans()),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(st.text(max_size=6).filter(lambda k: k == k.lower()), children, max_size=3),
    ),
    max_leaves=8,
)


@given(st.dictionaries(st.sampled_from(["a", "b", "model", "x/y", ""]), trees, min_size=1))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_round_trip_property(tmp_path_factory, tree):
    path = tmp_path_factory.mktemp("prop") / "c"
    eqxckpt.save(path, tree)
    assert_trees_equal(eqxckpt.load(path, tree), tree)
    plain = eqxckpt.load(path)
    # like=None rebuilds the same nested dicts/lists where nothing is empty
    for key in tree:
        if jax.tree_util.tree_leaves(tree[key]):
            assert key in plain


# The dtypes whose bytes have an order (the float8 and int4 kinds are single bytes or less).
BYTE_ORDER_DTYPES = [d for d in NUMPY_DTYPES if np.dtype(d).itemsize > 1 or d in (np.int8, np.uint8, np.bool_)]


def _every_bit_pattern(dtype, count, seed):
    """``count`` random values of ``dtype``, from random bytes: NaN payloads and -0.0 too
    (bools are 0 or 1)."""
    raw = np.random.default_rng(seed).integers(0, 256, count * np.dtype(dtype).itemsize, dtype=np.uint8)
    return (raw % 2 if dtype is np.bool_ else raw).view(dtype)


@given(
    dtype=st.sampled_from(BYTE_ORDER_DTYPES),
    order=st.sampled_from("<>="),
    packed=st.booleans(),
    blocking=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_byte_order_is_stored_little_endian_and_loads_bit_exact(
    tmp_path_factory, dtype, order, packed, blocking, seed
):
    # Packed: a small leaf among many (its bytes go into the packed array); else one large
    # enough for its own array. Either way the stored bytes, the digest and the load agree.
    count = 5 if packed else PACK_MAX_BYTES // np.dtype(dtype).itemsize + 3
    native = _every_bit_pattern(dtype, count, seed)
    value = native.astype(native.dtype.newbyteorder(order))
    assert np.array_equal(value.view(np.uint8), native.view(np.uint8)) == (order != ">" or value.itemsize == 1)
    path = tmp_path_factory.mktemp("order") / "c"
    tree = {"x": value, "pad": [np.arange(4, dtype=np.float32) + i for i in range(PACK_MIN_LEAVES)]}
    eqxckpt.save(path, tree, blocking=blocking).wait()
    [record] = [leaf for leaf in manifest_doc((path / "eqxckpt.json").read_text())["leaves"] if leaf["path"] == "x"]
    assert ("offset" in record) == packed
    for got in [eqxckpt.load(path)["x"], eqxckpt.open(path)["x"].get()]:
        assert got.dtype == native.dtype and got.dtype.isnative
        assert got.tobytes() == native.tobytes()
    report = eqxckpt.verify(path)
    assert report.ok and not report.problems, report


class Config(dict):
    """A dict subclass: JAX does not flatten it, so to JAX it is one opaque leaf."""


class Holder:
    def __init__(self, w):
        self.w = w


@pytest.mark.parametrize(
    "leaf, words",
    [
        (Config(w=np.ones(3)), "dict subclass"),
        (Holder(np.ones(3)), "single leaf"),
        (np.ma.masked_array([1.0, 2.0], mask=[False, True]), "masked array"),
        (jax.ShapeDtypeStruct((3,), jnp.float32), "ShapeDtypeStruct"),
        (b"raw bytes", "single leaf"),
        (functools.partial(np.add, np.ones(3)), "single leaf"),
    ],
)
def test_leaves_that_may_hold_data_are_refused_not_lost(tmp_path, leaf, words):
    with pytest.raises(eqxckpt.UnsupportedLeafError, match=words) as caught:
        eqxckpt.save(tmp_path / "c", {"model": {"part": leaf}})
    assert "'model/part'" in str(caught.value)
    assert not (tmp_path / "c").exists() and not os.listdir(tmp_path)  # nothing written


def test_functions_and_classes_are_recorded_by_type(tmp_path):
    tree = {
        "relu": jax.nn.relu,
        "fn": lambda x: x,
        "jitted": jax.jit(jnp.sin),
        "cls": jnp.float32,
        "dtype": np.dtype("int8"),
        "partial": functools.partial(jnp.add, 1),
        "method": "abc".upper,
    }
    eqxckpt.save(tmp_path / "c", tree)
    ckpt = eqxckpt.open(tmp_path / "c")
    assert {p: ckpt.leaf(p).kind for p in ckpt.paths} == {p: "opaque" for p in tree}
    assert eqxckpt.load(tmp_path / "c", tree)["relu"] is jax.nn.relu


def test_saving_a_lazy_tree_copies_the_checkpoint(tmp_path):
    model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
    state = {
        "model": model,
        "opt": optax.adam(1e-3).init(eqx.filter(model, eqx.is_array)),
        "step": 4,
        "key": jax.random.key(3),
        "np": np.arange(6, dtype=np.int16).reshape(2, 3),
    }
    eqxckpt.save(tmp_path / "src", state, metadata={"m": 1})
    source = eqxckpt.open(tmp_path / "src")
    eqxckpt.save(tmp_path / "dst", source.tree())
    assert eqxckpt.verify(tmp_path / "dst").ok
    assert_trees_equal(eqxckpt.load(tmp_path / "dst", state), state)
    # a part, sliced and cast lazily: only that is read and written
    eqxckpt.save(tmp_path / "part", {"w": source["model/layers/0/weight"][:2].astype(np.float16), "np": source["np"]})
    part = eqxckpt.load(tmp_path / "part")
    np.testing.assert_array_equal(part["w"], np.asarray(model.layers[0].weight[:2]).astype(np.float16))
    assert part["np"].dtype == np.int16 and isinstance(part["np"], np.ndarray)


def test_a_lazy_copy_whose_source_is_replaced_commits_nothing(tmp_path, monkeypatch):
    eqxckpt.save(tmp_path / "src", {"w": np.zeros(1000), "v": np.ones(10)})
    tree = eqxckpt.open(tmp_path / "src").tree()
    real = eqxckpt._write._save._write

    def replace_source_midway(target, leaves, **what):
        real(target, leaves, **what)
        if what["chunks"]:
            monkeypatch.setattr(eqxckpt._write._save, "_write", real)
            eqxckpt.save(tmp_path / "src", {"w": np.ones(1000), "v": np.ones(10)}, overwrite=True)  # another process

    monkeypatch.setattr(eqxckpt._write._save, "_write", replace_source_midway)
    with pytest.raises(eqxckpt.CheckpointChangedError):
        eqxckpt.save(tmp_path / "dst", tree)
    assert not (tmp_path / "dst").exists()


def test_leaves_and_lazy_selections_of_many_chunks_are_written_chunk_by_chunk(tmp_path, monkeypatch):
    """One write per chunk: a lazy selection keeps its origin (rows 3..36), and is still
    copied to the right place, whole and cast."""
    import eqxckpt._chunks as chunks_module

    monkeypatch.setattr(chunks_module, "CHUNK_BYTES", 1024)  # 4 rows of 64 float32 per chunk
    w = np.arange(40 * 64, dtype=np.float32).reshape(40, 64)
    eqxckpt.save(tmp_path / "a", {"w": w})
    assert len(os.listdir(tmp_path / "a" / "w" / "c")) == 10
    lazy = eqxckpt.open(tmp_path / "a")["w"]
    eqxckpt.save(tmp_path / "b", {"part": lazy[3:37], "cast": lazy.astype("float16"), "whole": lazy})
    out = eqxckpt.load(tmp_path / "b")
    np.testing.assert_array_equal(out["part"], w[3:37])
    np.testing.assert_array_equal(out["cast"], w.astype(np.float16))
    np.testing.assert_array_equal(out["whole"], w)


# --- Equinox's own trees: every layer, tied weights, state, and its serialisation tests' trees ---


def _every_equinox_layer(key):
    keys = iter(jax.random.split(key, 64))
    return {
        "linear": eqx.nn.Linear(3, 4, key=next(keys)),
        "linear_scalar": eqx.nn.Linear("scalar", "scalar", key=next(keys)),
        "identity": eqx.nn.Identity(),
        "conv1d": eqx.nn.Conv1d(2, 3, 3, key=next(keys)),
        "conv2d": eqx.nn.Conv2d(2, 3, (2, 3), padding="SAME", key=next(keys)),
        "conv3d": eqx.nn.Conv3d(1, 2, 2, use_bias=False, key=next(keys)),
        "convt1d": eqx.nn.ConvTranspose1d(2, 3, 3, key=next(keys)),
        "convt2d": eqx.nn.ConvTranspose2d(2, 3, 2, key=next(keys)),
        "convt3d": eqx.nn.ConvTranspose3d(1, 2, 2, key=next(keys)),
        "embedding": eqx.nn.Embedding(10, 4, key=next(keys)),
        "mlp": eqx.nn.MLP(3, 2, 8, 2, activation=jax.nn.gelu, key=next(keys)),
        "dropout": eqx.nn.Dropout(0.3),
        "layernorm": eqx.nn.LayerNorm(5),
        "rmsnorm": eqx.nn.RMSNorm(5),
        "groupnorm": eqx.nn.GroupNorm(2, 4),
        "weightnorm": eqx.nn.WeightNorm(eqx.nn.Linear(3, 3, key=next(keys))),
        "attention": eqx.nn.MultiheadAttention(2, 8, key=next(keys)),
        "rope": eqx.nn.RotaryPositionalEmbedding(8),
        "gru": eqx.nn.GRUCell(3, 4, key=next(keys)),
        "lstm": eqx.nn.LSTMCell(3, 4, key=next(keys)),
        "sequential": eqx.nn.Sequential(
            [eqx.nn.Linear(3, 3, key=next(keys)), eqx.nn.Lambda(jax.nn.relu), eqx.nn.PReLU()]
        ),
        "pools": [
            eqx.nn.MaxPool1d(2),
            eqx.nn.MaxPool2d(2, 2),
            eqx.nn.MaxPool3d(2),
            eqx.nn.AvgPool1d(2),
            eqx.nn.AvgPool2d(2),
            eqx.nn.AvgPool3d(2),
            eqx.nn.AdaptiveAvgPool1d(2),
            eqx.nn.AdaptiveAvgPool2d((2, 2)),
            eqx.nn.AdaptiveAvgPool3d(2),
            eqx.nn.AdaptiveMaxPool1d(2),
            eqx.nn.AdaptiveMaxPool2d(2),
            eqx.nn.AdaptiveMaxPool3d(2),
        ],
        "batchnorm": eqx.nn.BatchNorm(4, "batch", mode="batch"),
        "spectralnorm": eqx.nn.SpectralNorm(eqx.nn.Linear(3, 3, key=next(keys)), "weight", key=next(keys)),
    }


class TiedModel(eqx.Module):
    """An embedding tied to the output layer with `eqx.nn.Shared`."""

    shared: eqx.nn.Shared

    def __init__(self, key):
        embed_key, head_key = jax.random.split(key)
        embedding = eqx.nn.Embedding(10, 4, key=embed_key)
        head = eqx.nn.Linear(4, 10, key=head_key)
        self.shared = eqx.nn.Shared((embedding, head), lambda pair: pair[1].weight, lambda pair: pair[0].weight)

    def __call__(self, token):
        embedding, head = self.shared()
        return head(embedding(token))


def _as_in(like, tree):
    """``tree``'s leaves in ``like``'s structure (a State's markers are objects of its own)."""
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), jax.tree_util.tree_leaves(tree))


def _layers_and_state(key):
    layers = _every_equinox_layer(key)
    return {"layers": layers, "tied": TiedModel(key)}, eqx.nn.State(layers)


def test_every_equinox_layer_and_its_state_round_trip_bit_exact(tmp_path):
    model, state = _layers_and_state(jax.random.key(0))
    eqxckpt.save(tmp_path / "ckpt", {"model": model, "state": state})
    other_model, other_state = _layers_and_state(jax.random.key(1))
    like = {"model": other_model, "state": other_state}
    restored = eqxckpt.load(tmp_path / "ckpt", like)
    arrays = eqx.filter(_as_in(like, {"model": model, "state": state}), eqx.is_array)
    assert_trees_equal(eqx.filter(restored, eqx.is_array), arrays)
    # Functions (activations, norms) come from `like`, scalars from the checkpoint.
    assert restored["model"]["layers"]["mlp"].activation is other_model["layers"]["mlp"].activation
    # Into a skeleton: nothing initialised, the same values come back.
    skeleton = eqx.filter_eval_shape(lambda k: dict(zip(("model", "state"), _layers_and_state(k))), jax.random.key(2))
    from_skeleton = eqxckpt.load(tmp_path / "ckpt", skeleton)
    assert_trees_equal(
        jax.tree_util.tree_leaves(eqx.filter(from_skeleton, eqx.is_array)), jax.tree_util.tree_leaves(arrays)
    )
    # The stateful layers still run, on the restored state.
    x = jnp.arange(4.0)
    out, _ = jax.vmap(
        from_skeleton["model"]["layers"]["batchnorm"], in_axes=(0, None), out_axes=(0, None), axis_name="batch"
    )(jnp.stack([x, x + 1]), from_skeleton["state"])
    want, _ = jax.vmap(model["layers"]["batchnorm"], in_axes=(0, None), out_axes=(0, None), axis_name="batch")(
        jnp.stack([x, x + 1]), state
    )
    np.testing.assert_array_equal(out, want)


def test_shared_tied_weights_stay_tied_after_load(tmp_path):
    model = TiedModel(jax.random.key(0))
    eqxckpt.save(tmp_path / "ckpt", {"model": model})
    listing = eqxckpt.open(tmp_path / "ckpt")
    placeholder = listing.leaf("model/shared/pytree/1/weight")
    assert placeholder.kind == "opaque" and placeholder.describe() == "<equinox.nn._shared.SharedNode>"
    for like in (TiedModel(jax.random.key(1)), eqx.filter_eval_shape(TiedModel, jax.random.key(1))):
        restored = eqxckpt.load(tmp_path / "ckpt", {"model": like})["model"]
        embedding, head = restored.shared()
        assert head.weight is embedding.weight  # tied: one array, not two equal copies
        np.testing.assert_array_equal(embedding.weight, model.shared()[0].weight)
        np.testing.assert_array_equal(head.bias, model.shared()[1].bias)
        np.testing.assert_array_equal(restored(3), model(3))


@pytest.mark.filterwarnings("ignore:When `eqx.nn.BatchNorm")
def test_equinox_serialisation_test_trees_round_trip(tmp_path):
    """The trees of Equinox's own tests/test_serialisation.py: a function and an object()
    are taken from `like`, everything else is restored."""
    tree = (jnp.array(1), jnp.array([1.0, 2.0]), np.array(1), np.array([1.0, 2.0]), (True, 1, 1.0, 1 + 1j))
    tree += (lambda x: x, object())
    like_func, like_obj = (lambda x: x), object()
    like = (jnp.array(5), jnp.array([6.0, 7.0]), np.array(5), np.array([6.0, 7.0]), (False, 6, 6.0, 6 + 6j))
    like += (like_func, like_obj)
    eqxckpt.save(tmp_path / "ckpt", tree)
    restored = eqxckpt.load(tmp_path / "ckpt", like)
    assert_trees_equal(restored[:5], tree[:5])
    assert restored[5] is like_func and restored[6] is like_obj
    assert eqxckpt.load(tmp_path / "ckpt")[6] is None  # like=None: nothing to take it from
    # Equinox's test_stateful: two BatchNorms and their State.
    model = (eqx.nn.BatchNorm(3, "hi"), eqx.nn.BatchNorm(4, "bye"))
    eqxckpt.save(tmp_path / "stateful", (model, eqx.nn.State(model)))
    model2 = (eqx.nn.BatchNorm(3, "hi"), eqx.nn.BatchNorm(4, "bye"))
    like = (model2, eqx.nn.State(model2))
    restored = eqxckpt.load(tmp_path / "stateful", like)
    assert_trees_equal(restored, _as_in(like, (model, eqx.nn.State(model))))


class Marker:
    """An object with no attributes: provably no data."""


class Holder:
    def __init__(self, value):
        self.value = value


class Slotted:
    __slots__ = ("value",)

    def __init__(self, value=None):
        if value is not None:
            self.value = value


@pytest.mark.parametrize(
    "leaf, saved",
    [
        (object(), True),
        (Marker(), True),
        (Slotted(), True),
        (Holder(np.ones(3)), False),  # attributes hold an array
        (Holder(0.5), False),  # ...or any value: it would be lost
        (Slotted(np.ones(3)), False),
        ({1, 2}, False),  # containers JAX does not flatten
        (frozenset(), False),
        (b"bytes", False),
        (bytearray(b"x"), False),
        (range(3), False),
        (slice(1, 2), False),
        (np.random.default_rng(0), False),  # state kept in C
        (threading.Lock(), False),
    ],
)
def test_objects_are_saved_only_when_they_provably_hold_no_data(tmp_path, leaf, saved):
    if saved:
        eqxckpt.save(tmp_path / "ckpt", {"x": leaf, "w": np.ones(2)})
        assert eqxckpt.open(tmp_path / "ckpt").leaf("x").kind == "opaque"
        like = {"x": type(leaf)(), "w": np.zeros(2)}
        assert eqxckpt.load(tmp_path / "ckpt", like)["x"] is like["x"]
    else:
        with pytest.raises(eqxckpt.UnsupportedLeafError, match="Leaf 'x'"):
            eqxckpt.save(tmp_path / "ckpt", {"x": leaf, "w": np.ones(2)})
        assert not (tmp_path / "ckpt").exists()


def test_saving_over_a_symlink_is_refused_and_leaves_the_link(tmp_path):
    eqxckpt.save(tmp_path / "step_1", {"w": np.ones(2)})
    (tmp_path / "latest").symlink_to(tmp_path / "step_1")
    for overwrite in (False, True):
        with pytest.raises(eqxckpt.CheckpointError, match="it is a symlink"):
            eqxckpt.save(tmp_path / "latest", {"w": np.zeros(2)}, overwrite=overwrite)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_1"]
    assert (tmp_path / "latest").is_symlink() and eqxckpt.load(tmp_path / "latest")["w"].tolist() == [1.0, 1.0]


@pytest.mark.multiprocess
def test_an_abort_at_exit_cannot_cut_a_background_save_short(tmp_path):
    """A script that ends while its background save runs, in a process that then aborts
    during interpreter exit (as native libraries' teardown sometimes does: SIGABRT,
    'terminate called without an active exception'): the save was committed first."""
    script = f"""
import atexit, os
import numpy as np, eqxckpt
atexit.register(os.abort)  # runs at exit, after every background save has finished
tree = {{f"w{{i}}": np.full((1024, 1024), i, np.float32) for i in range(32)}}  # 128 MiB
eqxckpt.save({str(tmp_path / "ckpt")!r}, tree, blocking=False)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, env=dict(os.environ, JAX_PLATFORMS="cpu")
    )
    assert done.returncode == -6, done  # SIGABRT, after the script's end
    restored = eqxckpt.load(tmp_path / "ckpt")
    assert set(restored) == {f"w{i}" for i in range(32)} and all(restored[f"w{i}"][0, 0] == i for i in range(32))
    assert eqxckpt.verify(tmp_path / "ckpt").ok


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(position=st.integers(0, 70_000 * 4 + 3), bit=st.integers(0, 7), packed=st.booleans())
def test_any_flipped_bit_in_a_base_is_written_again_not_shared(tmp_path_factory, position, bit, packed):
    """save(base=...) takes no byte of ``base`` unchecked: whichever bit of a chunk file of an
    unchanged leaf (its values or its checksum; or the packed array's) flipped, the new
    checkpoint holds the values saved, and intact ones are still linked."""
    root = tmp_path_factory.mktemp("rot")
    tree = {
        "big": np.random.default_rng(0).standard_normal(70_000).astype(np.float32),  # one chunk, not packed
        "other": np.arange(70_000, dtype=np.float32),
        "small": [np.full(4, i, np.float32) for i in range(40)],
    }
    eqxckpt.save(root / "a", tree)
    damaged = root / "a" / ("%packed/c/0" if packed else "big/c/0")
    data = bytearray(damaged.read_bytes())
    data[position % len(data)] ^= 1 << bit
    damaged.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="small/" if packed else "'big'"):
        eqxckpt.save(root / "b", tree, base=root / "a")
    assert_trees_equal(eqxckpt.load(root / "b", tree), tree)
    assert eqxckpt.verify(root / "b").ok
    other = "big/c/0" if packed else "%packed/c/0"
    assert os.stat(root / "b" / other).st_ino == os.stat(root / "a" / other).st_ino  # intact: still shared
    assert os.stat(root / "b" / damaged.relative_to(root / "a")).st_nlink == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"metadata": {"a": object()}},  # "metadata that is not JSON", as ArgumentError's docstring says
        {"metadata": 5},
    ],
)
def test_bad_save_arguments_are_argument_errors(tmp_path, kwargs):
    with pytest.raises(eqxckpt.ArgumentError, match="metadata"):
        eqxckpt.save(tmp_path / "c", {"w": np.ones(3, np.float32)}, **kwargs)


def test_a_bare_array_given_to_save_is_an_argument_error(tmp_path):
    with pytest.raises(eqxckpt.ArgumentError, match="container"):
        eqxckpt.save(tmp_path / "c", np.ones(3, np.float32))


# -- a save never writes what a load refuses (#53, defect 0) -----------------------------------


def test_a_manifest_a_load_would_refuse_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    import eqxckpt._manifest._document as manifest_module

    # Over the reader's 64 MiB cap: metadata, a string leaf (each refused before a chunk is written).
    with pytest.raises(eqxckpt.ArgumentError, match="manifest would be .* bytes; a load reads manifests of at most"):
        eqxckpt.save(tmp_path / "meta", {"w": np.zeros(2)}, metadata={"blob": "x" * (70 << 20)})
    with pytest.raises(eqxckpt.ArgumentError, match="manifest would be"):
        eqxckpt.save(tmp_path / "string", {"s": "y" * (66 << 20), "w": np.zeros(2)})
    assert not (tmp_path / "meta").exists() and not (tmp_path / "string").exists()
    # Many small leaves, the cap made small: refused exactly at the line, whatever the estimate says.
    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", 64 * 1024)
    many = {f"p{i}": {f"l{j}": np.float32(j) for j in range(100)} for i in range(16)}  # about 75 KB
    with pytest.raises(eqxckpt.ArgumentError, match="manifest would be"):
        eqxckpt.save(tmp_path / "many", many)
    assert not (tmp_path / "many").exists()
    fewer = {f"p{i}": {f"l{j}": np.float32(j) for j in range(100)} for i in range(9)}  # over the bound, under the cap
    eqxckpt.save(tmp_path / "fewer", fewer)
    assert (tmp_path / "fewer" / "eqxckpt.json").stat().st_size <= 64 * 1024
    assert eqxckpt.load(tmp_path / "fewer")["p8"]["l99"] == 99
    # The commit's own check, whatever came before it.
    manifest = manifest_module.Manifest((), {"x": "y" * 300_000})
    with pytest.raises(eqxckpt.ArgumentError, match="manifest would be"):
        manifest.to_bytes()


def test_a_shape_a_load_would_refuse_is_refused_at_save_naming_the_leaf(tmp_path):
    with pytest.raises(eqxckpt.UnsupportedLeafError, match=r"Leaf 'z'.*absurd number of elements.*not saved"):
        eqxckpt.save(tmp_path / "c", {"w": np.ones(2), "z": np.zeros((0, 2**20, 2**20, 2**20), np.int8)})
    assert not (tmp_path / "c").exists()


def test_a_chunk_layout_a_load_would_refuse_is_refused_at_save(tmp_path, monkeypatch):
    import eqxckpt._chunks as chunks_module

    eqxckpt.save(tmp_path / "ok", {"w": np.arange(5000, dtype=np.float32)})
    # The one check, `ChunkLayout.refusal`, is the reader's and the writer's: with a smaller
    # bound on chunks, the save is refused before it writes, and the checkpoint made before is refused.
    monkeypatch.setattr(chunks_module, "MAX_CHUNK_BYTES", 1024)
    with pytest.raises(eqxckpt.UnsupportedLeafError, match=r"Leaf 'w' \(float32\[5000\]\).*over 1024 bytes.*not saved"):
        eqxckpt.save(tmp_path / "c", {"w": np.arange(5000, dtype=np.float32)})
    assert not (tmp_path / "c").exists()
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="over 1024 bytes"):
        eqxckpt.load(tmp_path / "ok")


def test_saving_over_a_checkpoint_leaves_files_eqxckpt_did_not_write_with_a_warning(tmp_path):
    """#53 defect 7, overwrite: the files another tool put in a checkpoint are not deleted
    with it; they are left in a directory beside it, named in a warning."""
    eqxckpt.save(tmp_path / "c", {"w": np.arange(4.0)})
    (tmp_path / "c" / "notes.txt").write_text("mine")
    with pytest.warns(UserWarning, match=r"Saving over .* left 1 files .* now in .*c\.replaced-.*: notes.txt"):
        eqxckpt.save(tmp_path / "c", {"w": np.arange(4.0) + 1}, overwrite=True)
    assert eqxckpt.load(tmp_path / "c")["w"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert eqxckpt.open(tmp_path / "c").stored.unwritten() == []
    [kept] = tmp_path.glob("c.replaced-*")
    assert sorted(p.name for p in kept.rglob("*")) == ["notes.txt"] and (kept / "notes.txt").read_text() == "mine"


def test_a_file_put_in_a_checkpoint_while_a_save_replaces_it_is_kept(tmp_path):
    """The files kept are those the replaced checkpoint holds when it is replaced, not when
    the save began: a file another tool puts in it while the save writes is kept too."""
    eqxckpt.save(tmp_path / "c", {"w": np.arange(4.0)})

    def put_a_file_midway(*counts: int) -> None:  # called as the chunks are written
        if not (tmp_path / "c" / "late.txt").exists():
            (tmp_path / "c" / "late.txt").write_text("mine")

    with pytest.warns(UserWarning, match=r"left 1 files .*: late.txt"):
        eqxckpt.save(tmp_path / "c", {"w": np.arange(4.0) + 1}, overwrite=True, progress=put_a_file_midway)
    [kept] = tmp_path.glob("c.replaced-*")
    assert (kept / "late.txt").read_text() == "mine"
