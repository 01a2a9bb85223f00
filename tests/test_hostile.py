"""Checkpoints from anywhere: crafted ones never make eqxckpt read or write outside
them, run code, or allocate memory that no data backs. Only documented errors come out."""

import copy
import json
import os
import stat

import numpy as np
import pytest
from conftest import WORKERS, crafted_manifest, manifest_doc
from hypothesis import HealthCheck, given, settings, strategies as st

import eqxckpt
from eqxckpt._cli import main as cli
from eqxckpt._manifest import parse_manifest
from eqxckpt._stored import _ZARR_KEYS

DOCUMENTED = (eqxckpt.CheckpointError,)  # every error eqxckpt raises on purpose derives from it


def snapshot(root):
    """Every entry below ``root`` with its size and mtime: to prove nothing was written."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st_ = os.lstat(os.path.join(dirpath, name))
            out[os.path.join(dirpath, name)] = (st_.st_size, st_.st_mtime_ns, stat.S_IFMT(st_.st_mode))
    return out


def every_reader(path):
    """Run load, open, inspect and verify on ``path``; return what each raised or returned."""
    outcomes = {}
    for name, run in {
        "load": lambda: eqxckpt.load(path),
        "open": lambda: [eqxckpt.open(path)[p] for p in eqxckpt.open(path).paths],
        "lazy get": lambda: [
            v.get() for v in (eqxckpt.open(path)[p] for p in eqxckpt.open(path).paths) if hasattr(v, "get")
        ],
        "lazy slice": lambda: [  # a selection reads only its chunks, through the same checks
            v[1:].get()
            for v in (eqxckpt.open(path)[p] for p in eqxckpt.open(path).paths)
            if getattr(v, "ndim", 0) and v.leaf.sliceable
        ],
        "inspect": lambda: cli(["inspect", str(path)]),
        "verify": lambda: eqxckpt.verify(path),
    }.items():
        try:
            outcomes[name] = run()
        except DOCUMENTED as e:
            outcomes[name] = e
    return outcomes


@pytest.fixture
def world(tmp_path):
    """A checkpoint, and a secret outside it that a hostile checkpoint might reach for."""
    secret = tmp_path / "outside"
    eqxckpt.save(secret, {"w": np.full((6, 8), 7.0, np.float32)})
    ckpt = tmp_path / "c"
    eqxckpt.save(ckpt, {"w": np.zeros((6, 8), np.float32), "step": 1})
    return tmp_path, ckpt, secret


def rewrite_manifest(ckpt, edit):
    doc = manifest_doc((ckpt / "eqxckpt.json").read_text())
    edit(doc)
    (ckpt / "eqxckpt.json").write_bytes(crafted_manifest(doc))


@pytest.mark.parametrize(
    "bad_path", ["../outside/w", "/etc/passwd", "w/../../outside/w", "a\x00b", "a\\b", "", ".", "w/./x"]
)
def test_manifest_paths_cannot_leave_the_checkpoint(world, bad_path, capsys):
    root, ckpt, _ = world

    def edit(doc):
        leaf = next(leaf for leaf in doc["leaves"] if leaf["path"] == "w")
        leaf["path"] = leaf["location"] = bad_path

    rewrite_manifest(ckpt, edit)
    before = snapshot(root)
    outcomes = every_reader(ckpt)
    assert snapshot(root) == before
    assert isinstance(outcomes["load"], eqxckpt.ManifestError) and isinstance(outcomes["open"], eqxckpt.ManifestError)
    assert outcomes["inspect"] == 1 and not outcomes["verify"].ok


def test_symlinks_out_of_the_checkpoint_are_refused(world):
    root, ckpt, secret = world
    cases = {
        "leaf directory": (ckpt / "w", secret / "w"),
        "chunk file": (ckpt / "w/c/0/0", secret / "w/c/0/0"),
        "metadata": (ckpt / "w/zarr.json", secret / "w/zarr.json"),
    }
    for what, (link, target) in cases.items():
        backup = link.with_name(link.name + ".bak")
        link.rename(backup)
        link.symlink_to(target, target_is_directory=target.is_dir())
        try:
            before = snapshot(root)
            outcomes = every_reader(ckpt)
            assert snapshot(root) == before
            assert isinstance(outcomes["load"], eqxckpt.CorruptCheckpointError), what
            assert "symlink" in str(outcomes["load"]) and "'w'" in str(outcomes["load"]), what
            assert isinstance(outcomes["lazy get"], eqxckpt.CorruptCheckpointError), what
            assert not outcomes["verify"].ok and outcomes["inspect"] == 0  # inspect reads only the manifest
        finally:
            link.unlink()
            backup.rename(link)
    assert eqxckpt.verify(ckpt).ok


def test_symlinked_or_special_manifest_is_refused(world):
    root, ckpt, secret = world
    (ckpt / "eqxckpt.json").unlink()
    (ckpt / "eqxckpt.json").symlink_to(secret / "eqxckpt.json")
    with pytest.raises(eqxckpt.ManifestError, match="symlink"):
        eqxckpt.load(ckpt)
    (ckpt / "eqxckpt.json").unlink()
    os.mkfifo(ckpt / "eqxckpt.json")  # would block a naive reader forever
    with pytest.raises(eqxckpt.ManifestError, match="not a regular file"):
        eqxckpt.open(ckpt)


def test_fifo_inside_a_leaf_is_refused(world):
    _, ckpt, _ = world
    os.mkfifo(ckpt / "w/c/0/fifo")
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="special file"):
        eqxckpt.load(ckpt)


def test_declared_shape_must_be_backed_by_data(world):
    """A crafted 4 TiB shape fails before anything is allocated for it."""
    _, ckpt, _ = world
    huge = [1 << 40]

    def edit(doc):
        leaf = next(leaf for leaf in doc["leaves"] if leaf["path"] == "w")
        leaf["shape"] = huge

    rewrite_manifest(ckpt, edit)
    meta = json.loads((ckpt / "w/zarr.json").read_text())
    meta["shape"], meta["chunk_grid"]["configuration"]["chunk_shape"] = huge, huge
    (ckpt / "w/zarr.json").write_text(json.dumps(meta))
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="declares 4398046511104 bytes"):
        eqxckpt.load(ckpt)
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="declares"):
        eqxckpt.open(ckpt)["w"].get()
    assert not eqxckpt.verify(ckpt).ok


def test_enormous_and_deeply_nested_manifests(world):
    _, ckpt, _ = world
    os.truncate(ckpt / "eqxckpt.json", 300 * 2**20)  # sparse: costs no disk
    with pytest.raises(eqxckpt.ManifestError, match="limit"):
        eqxckpt.open(ckpt)
    (ckpt / "eqxckpt.json").write_text(
        '{"format": "eqxckpt", "version": 1, "metadata": ' + "[" * 200_000 + "]" * 200_000 + "}"
    )
    with pytest.raises(eqxckpt.ManifestError):
        eqxckpt.open(ckpt)


# --- fuzzing the manifest parser ------------------------------------------------------

GOOD_DOC = None


def good_doc(tmp_path_factory):
    global GOOD_DOC
    if GOOD_DOC is None:
        path = tmp_path_factory.mktemp("fuzz") / "c"
        key = __import__("jax").random.key(0)
        eqxckpt.save(
            path, {"model": {"w": np.ones((2, 3)), "layers": [np.int8(3), 2.5]}, "k": key, "f": print, "s": "x"}
        )
        GOOD_DOC = manifest_doc((path / "eqxckpt.json").read_text())
    return copy.deepcopy(GOOD_DOC)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)


def parses_or_refuses(raw: bytes):
    try:
        parse_manifest(raw)
    except eqxckpt.ManifestError:
        pass  # the one documented outcome besides success


@settings(max_examples=1500, deadline=None)
@given(st.binary(max_size=400))
def test_fuzz_arbitrary_bytes(raw):
    parses_or_refuses(raw)


@settings(max_examples=1500, deadline=None)
@given(json_values)
def test_fuzz_arbitrary_json(doc):
    parses_or_refuses(json.dumps(doc).encode())
    parses_or_refuses(json.dumps({"format": "eqxckpt", "version": 1, "metadata": {}, "leaves": [doc]}).encode())


LEAF_FIELDS = ["path", "location", "keys", "kind", "shape", "dtype", "array_type", "impl", "key_shape", "type", "value"]


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 50), st.sampled_from(LEAF_FIELDS + ["<delete>"]), st.sampled_from(LEAF_FIELDS), json_values)
def test_fuzz_mutated_manifests(tmp_path_factory, leaf_index, action, field, value):
    doc = good_doc(tmp_path_factory)
    leaf = doc["leaves"][leaf_index % len(doc["leaves"])]
    if action == "<delete>":
        leaf.pop(field, None)
    else:
        leaf[action] = value
    parses_or_refuses(crafted_manifest(doc))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.integers(0, 50),
    st.sampled_from(LEAF_FIELDS),
    json_values
    | st.sampled_from(
        [
            [["dict", "model"], ["seq", 0]],
            [["seq", 0]],
            [["attr", "k"]],
            [["dict", 3]],
            [2, 3],
            [[]],
            "w",
            "k",
            "model/w",
        ]
    ),
)
def test_fuzz_crafted_checkpoints_end_to_end(tmp_path_factory, leaf_index, field, value):
    """Mutated manifests in a real checkpoint: every reader succeeds or raises a documented error."""
    doc = good_doc(tmp_path_factory)
    leaf = doc["leaves"][leaf_index % len(doc["leaves"])]
    leaf[field] = value
    if field == "path":
        leaf["location"] = value
    path = tmp_path_factory.mktemp("crafted") / "c"
    eqxckpt.save(
        path,
        {
            "model": {"w": np.ones((2, 3)), "layers": [np.int8(3), 2.5]},
            "k": __import__("jax").random.key(0),
            "f": print,
            "s": "x",
        },
    )
    (path / "eqxckpt.json").write_bytes(crafted_manifest(doc))
    every_reader(path)  # raises if anything but a CheckpointError escapes


def test_leaves_must_describe_one_tree(world):
    _, ckpt, _ = world
    eqxckpt.save(ckpt, {"a": {"0": np.ones(2), "x": np.zeros(2)}}, overwrite=True)
    doc = manifest_doc((ckpt / "eqxckpt.json").read_text())
    doc["leaves"][0]["keys"][1] = ["seq", 0]  # "a" is now both a list and a dict
    (ckpt / "eqxckpt.json").write_bytes(crafted_manifest(doc))
    with pytest.raises(eqxckpt.ManifestError, match="inconsistent at 'a'"):
        eqxckpt.load(ckpt)


def test_unknown_prng_implementation_is_a_manifest_error(world):
    """Found by the end-to-end fuzz: an unknown impl name used to escape as a ValueError."""
    _, ckpt, _ = world
    eqxckpt.save(ckpt, {"k": __import__("jax").random.key(0)}, overwrite=True)
    rewrite_manifest(ckpt, lambda doc: doc["leaves"][0].update(impl="w"))
    outcomes = every_reader(ckpt)
    assert isinstance(outcomes["load"], eqxckpt.ManifestError) and "'w'" in str(outcomes["load"])
    assert not outcomes["verify"].ok


# --- crafted zarr.json, sparse files, bombs (peak memory in fresh processes) ---

import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import tensorstore as ts  # noqa: E402

PROBE = str(WORKERS / "bomb_probe.py")


def probe(op, path):
    """Run one reader in a fresh process: (error class name, message, peak MiB)."""
    [result] = probes([op], path)
    return result


def probes(ops, path):
    """Run the readers ``ops`` one after another in one fresh process: for each, (op, error
    class name, message, peak MiB), its peak counted from its own start."""
    out = subprocess.run(
        [sys.executable, PROBE, ",".join(ops), str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert out.returncode == 0, out.stderr[-3000:]  # never a crash (SIGABRT, OOM kill)
    results = [json.loads(line) for line in out.stdout.strip().splitlines()[-len(ops) :]]
    assert [r["op"] for r in results] == list(ops), out.stdout[-3000:]
    for r in results:  # the figures, for the record (-s)
        print(f"{r['op']} {path}: {r['error']}, peak {r['peak_mib']:.1f} MiB")
    return [(r["error"], r["message"], r["peak_mib"]) for r in results]


def replace_leaf_array(ckpt, leaf, metadata, data):
    """Put an array TensorStore writes with ``metadata`` where leaf ``leaf`` was."""
    shutil.rmtree(ckpt / leaf)
    store = ts.open(
        {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(ckpt / leaf) + "/"},
            "metadata": metadata,
            "create": True,
        }
    ).result()
    store.write(data).result()


CRAFTED_ARRAYS = {
    # eqxckpt writes raw bytes + crc32c only: anything else is refused before it is opened
    "zstd": ({"codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd"}]}, "codecs"),
    "gzip without checksum": (
        {"codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "gzip"}]},
        "codecs",
    ),
    "sharding": (
        {
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": [1 << 20],
                        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
                        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                    },
                }
            ],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1 << 20]}},
        },
        "chunk grid",
    ),
    "huge chunk": ({"chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1 << 30]}}}, "chunk grid"),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(CRAFTED_ARRAYS))
def test_zarr_json_is_validated_before_any_array_is_opened(tmp_path, case):
    extra, expected = CRAFTED_ARRAYS[case]
    ckpt = tmp_path / "c"
    eqxckpt.save(ckpt, {"w": np.arange(4096, dtype=np.float32)})
    metadata = {"shape": [4096], "data_type": "float32", **extra}
    noise = np.random.default_rng(0).integers(0, 2**32, 4096, dtype=np.uint32).view(np.float32)  # incompressible
    replace_leaf_array(ckpt, "w", metadata, noise)
    for op, (error, message, peak) in zip(ops := ("load", "get", "verify"), probes(ops, ckpt)):
        assert error in ("CorruptCheckpointError", "VerifyReport") and "zarr.json" in message and expected in message, (
            op,
            message,
        )
        assert peak < 64, (op, peak)  # MiB: nothing near the crafted chunk's size is allocated


def test_zarr_json_fields_eqxckpt_never_writes_are_refused(world):
    _, ckpt, _ = world
    meta = json.loads((ckpt / "w/zarr.json").read_text())
    for key, value in [
        ("storage_transformers", [{"name": "x"}]),
        ("unknown", 1),
        ("zarr_format", 2),
        ("chunk_key_encoding", {"name": "v2"}),
    ]:
        (ckpt / "w/zarr.json").write_text(json.dumps({**meta, key: value}))
        with pytest.raises(eqxckpt.CorruptCheckpointError, match="zarr.json"):
            eqxckpt.load(ckpt)
        assert not eqxckpt.verify(ckpt).ok
    (ckpt / "w/zarr.json").write_text(json.dumps(meta))
    np.testing.assert_array_equal(eqxckpt.load(ckpt)["w"], np.zeros((6, 8), np.float32))


@pytest.mark.multiprocess
def test_huge_zarr_json_is_refused_without_reading_it(world):
    """120 MB of attributes: refused after reading 64 KiB of it, at no memory cost."""
    _, ckpt, _ = world
    meta = json.loads((ckpt / "w/zarr.json").read_text())
    meta["attributes"] = {"pad": "x" * (120 << 20)}
    (ckpt / "w/zarr.json").write_text(json.dumps(meta))
    error, message, peak = probe("load", ckpt)
    assert error == "CorruptCheckpointError" and "over 65536 bytes" in message and peak < 32, (message, peak)


@pytest.mark.multiprocess
def test_sparse_chunk_files_do_not_count_as_data(tmp_path):
    """2 GiB declared over a few KiB on disk: refused before any allocation."""
    ckpt = tmp_path / "c"
    eqxckpt.save(ckpt, {"w": np.zeros(16, np.float32)})
    doc = manifest_doc((ckpt / "eqxckpt.json").read_text())
    doc["leaves"][0]["shape"] = [1 << 29]
    (ckpt / "eqxckpt.json").write_bytes(crafted_manifest(doc))
    shutil.rmtree(ckpt / "w")
    chunk = 1 << 24  # 64 MiB chunks: a chunk grid eqxckpt could have written
    ts.open(
        {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(ckpt / "w") + "/"},
            "create": True,
            "metadata": {
                "shape": [1 << 29],
                "data_type": "float32",
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk]}},
                "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
            },
        }
    ).result()
    (ckpt / "w/c").mkdir()
    for i in range(32):  # every chunk file present with the right size, but sparse
        with open(ckpt / f"w/c/{i}", "wb") as f:
            f.truncate(chunk * 4 + 4)
    for op, (error, message, peak) in zip(ops := ("load", "get", "verify"), probes(ops, ckpt)):
        assert error in ("CorruptCheckpointError", "VerifyReport") and "on disk" in message, (op, message)
        assert peak < 64, (op, peak)


@pytest.mark.multiprocess
def test_dense_manifests_are_refused_before_parsing(world):
    """A 32 MiB manifest of empty objects would take ~800 MiB to parse: refused, at
    a cost near its own size."""
    _, ckpt, _ = world
    body = b'{"format": "eqxckpt", "version": 1, "metadata": {"x": [' + b"{}," * (11 << 20) + b'{}]}, "leaves": []}'
    (ckpt / "eqxckpt.json").write_bytes(body)
    error, message, peak = probe("open", ckpt)
    assert error == "ManifestError" and "densely packed" in message, message
    assert peak < 3 * len(body) / 2**20, peak


@pytest.mark.parametrize("legacy", [False, True], ids=["current", "written-before-sequences-were-complete"])
@pytest.mark.parametrize("index", [5, 400_000_000, 1 << 40])
def test_sequence_indices_are_exactly_0_to_n_minus_1(world, index, legacy):
    """Indices 0 and ``index`` alone: refused, never a huge list nor silent Nones.
    Manifests from before empty subtrees were recorded may have a few gaps."""
    _, ckpt, _ = world
    eqxckpt.save(ckpt, {"s": [np.zeros(2), np.ones(2)]}, overwrite=True)

    def edit(doc):
        for i, leaf in enumerate(doc["leaves"]):
            leaf["path"] = leaf["location"] = f"s/{i * index}"
            leaf["keys"] = [["dict", "s"], ["seq", i * index]]
        if legacy:
            del doc["sequences_complete"]

    rewrite_manifest(ckpt, edit)
    os.rename(ckpt / "s" / "1", ckpt / "s" / str(index))
    if legacy and index == 5:  # a gap an empty subtree left (None, (), optax.EmptyState()), or a lost leaf
        like = {"s": [np.zeros(2), None, None, None, None, np.zeros(2)]}
        assert eqxckpt.load(ckpt, like)["s"][5].tolist() == [1.0, 1.0]  # `like` says what the gap is
        with pytest.raises(eqxckpt.ManifestError, match=r"sequence at 's' has items \[0, 5\]"):
            eqxckpt.load(ckpt)  # without it, the gap is not guessed as Nones
        return
    with pytest.raises(eqxckpt.ManifestError, match="not exactly 0..1" if not legacy else "claims index"):
        eqxckpt.open(ckpt)


def test_empty_subtrees_keep_sequences_whole(tmp_path):
    """None, () and optax's EmptyState() in a sequence are recorded (as None), so the
    manifest can insist on indices 0..n-1; loads into `like` are unchanged."""
    import equinox as eqx
    import jax
    import optax

    model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
    opt = optax.chain(optax.clip(1.0), optax.adam(1e-3)).init(eqx.filter(model, eqx.is_array))
    tree = {"opt": opt, "seq": [np.ones(2), None, (), {}], "layers": eqx.nn.Sequential([eqx.nn.Identity()])}
    eqxckpt.save(tmp_path / "c", tree)
    ckpt = eqxckpt.open(tmp_path / "c")
    assert ckpt.leaf("opt/0").describe() == "none = None" and ckpt.leaf("seq/3").describe() == "none = None"
    assert eqxckpt.load(tmp_path / "c")["seq"][1:] == [None, None, None]
    restored = eqxckpt.load(tmp_path / "c", tree)  # strict: the recorded Nones are no difference
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(tree)


def test_object_store_manifest_is_read_only_up_to_the_limit(monkeypatch):
    """A huge manifest on an object store is refused after MAX_MANIFEST_BYTES + 1 bytes."""
    import eqxckpt._manifest._document as manifest_module

    monkeypatch.setattr(manifest_module, "MAX_MANIFEST_BYTES", 1000)
    store = ts.KvStore.open(
        {"driver": "memory", "path": "big-manifest/"}, context=eqxckpt._tensorstore.shared_context()
    ).result()
    store.write("eqxckpt.json", b" " * 5000).result()
    with pytest.raises(eqxckpt.ManifestError, match="over the 1000-byte limit"):
        eqxckpt.open("memory://big-manifest")


ZARR_FIELDS = [*sorted(_ZARR_KEYS), "extra"]  # every field eqxckpt accepts, and one it does not
zarr_values = json_values | st.sampled_from(
    [
        [1 << 40],
        [0],
        [-1],
        [2, 3],
        [3, 2],
        {"name": "regular", "configuration": {"chunk_shape": [1 << 31, 1]}},
        {"name": "regular", "configuration": {"chunk_shape": [1, 1]}},
        {"name": "rectilinear"},
        [{"name": "bytes"}, {"name": "crc32c"}],
        [{"name": "bytes", "configuration": {"endian": "big"}}, {"name": "crc32c"}],
        [{"name": "sharding_indexed", "configuration": {"chunk_shape": [1 << 30]}}],
        [{"name": "zstd"}],
        "float64",
        "int4",
        "bool",
        {"name": "default", "configuration": {"separator": "."}},
        "NaN",
        "Infinity",
    ]
)


def fuzz_rounds(request, fast, slow):
    return slow if request.config.getoption("--slow") else fast


def test_fuzz_zarr_json(tmp_path, request):
    """Mutated zarr.json files in a real checkpoint: every reader succeeds with the
    right values or raises a CheckpointError; nothing crashes the process."""
    path = tmp_path / "c"
    eqxckpt.save(path, {"w": np.arange(6, dtype=np.float32).reshape(2, 3)})
    original = json.loads((path / "w/zarr.json").read_text())

    @settings(max_examples=fuzz_rounds(request, 150, 3000), deadline=None)
    @given(st.sampled_from(ZARR_FIELDS), st.booleans(), zarr_values)
    def run(field, delete, value):
        doc = copy.deepcopy(original)
        if delete:
            doc.pop(field, None)
        else:
            doc[field] = value
        (path / "w/zarr.json").write_text(json.dumps(doc))
        outcomes = every_reader(path)
        refused = isinstance(outcomes["load"], eqxckpt.CheckpointError)
        if not refused:
            np.testing.assert_array_equal(outcomes["load"]["w"], np.arange(6, dtype=np.float32).reshape(2, 3))
            np.testing.assert_array_equal(outcomes["lazy slice"][0], np.arange(3, 6, dtype=np.float32).reshape(1, 3))
        # One validation for every path: a whole read, a selection and verify agree.
        assert isinstance(outcomes["lazy slice"], eqxckpt.CheckpointError) == refused, (field, delete, value)
        assert isinstance(outcomes["lazy get"], eqxckpt.CheckpointError) == refused, (field, delete, value)
        assert outcomes["verify"].ok == (not refused), (field, delete, value)

    run()


def test_fuzz_chunk_files(tmp_path, request):
    """Flipped, cut, replaced and extended chunk files: the crc32c catches every change to the data."""
    path = tmp_path / "c"
    expected = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    eqxckpt.save(path, {"w": expected})
    chunk = path / "w/c/0/0"
    original = chunk.read_bytes()

    @settings(max_examples=fuzz_rounds(request, 150, 3000), deadline=None)
    @given(
        st.integers(0, len(original) - 1),
        st.integers(1, 255),
        st.sampled_from(["flip", "cut", "extend", "junk"]),
        st.binary(max_size=64),
    )
    def run(at, xor, how, junk):
        raw = bytearray(original)
        if how == "flip":
            raw[at] ^= xor
        elif how == "cut":
            raw = raw[:at]
        elif how == "extend":
            raw += junk or b"\0"
        else:
            raw = bytearray(junk)
        chunk.write_bytes(bytes(raw))
        outcomes = every_reader(path)
        # Every change, bytes appended included, is refused by every reader alike.
        for name in ("load", "lazy get", "lazy slice"):
            assert isinstance(outcomes[name], eqxckpt.CorruptCheckpointError) == (raw != original), name
        assert outcomes["verify"].ok == (raw == original)

    run()
    chunk.write_bytes(original)
    np.testing.assert_array_equal(eqxckpt.load(path)["w"], expected)


@pytest.mark.multiprocess
def test_one_element_chunks_are_refused_before_any_read(tmp_path):
    """A 4 MiB leaf whose zarr.json declares 1,048,576 one-element chunks: every reader
    refuses it at once, naming the leaf, at no memory cost (it used to build a million
    chunk reads first: a MemoryError under a 2 GiB cap, or 75 s of verify)."""
    ckpt = tmp_path / "c"
    eqxckpt.save(ckpt, {"w": np.arange(1 << 20, dtype=np.float32)})
    meta = json.loads((ckpt / "w/zarr.json").read_text())
    meta["chunk_grid"]["configuration"]["chunk_shape"] = [1]
    (ckpt / "w/zarr.json").write_text(json.dumps(meta))
    for op, (error, message, peak) in zip(ops := ("load", "get", "slice", "verify"), probes(ops, ckpt)):
        assert error in ("CorruptCheckpointError", "VerifyReport"), (op, error, message)
        assert "'w'" in message and "1048576 chunks" in message, (op, message)
        assert peak < 32, (op, peak)  # MiB


def test_an_empty_leaf_lists_no_chunks_along_its_other_dimensions(tmp_path):
    """A leaf with no elements but a huge other dimension (0 x 2**46, as saved, and the
    same edited to one-element chunks, which the chunk-count bound lets through since it
    has none): every reader returns the empty array at once, at no memory cost (the one
    chunk reader listed every chunk along the huge dimension first: 661 MiB and 3.5 s
    as saved, without end as edited)."""
    saved, edited = tmp_path / "saved", tmp_path / "edited"
    for ckpt in (saved, edited):
        eqxckpt.save(ckpt, {"x": np.zeros((0, 1 << 46), np.uint8)})
    meta = json.loads((edited / "x/zarr.json").read_text())
    meta["chunk_grid"]["configuration"]["chunk_shape"] = [1, 1]
    (edited / "x/zarr.json").write_text(json.dumps(meta))
    for ckpt in (saved, edited):
        for op, (error, message, peak) in zip(ops := ("load", "get", "verify"), probes(ops, ckpt)):
            assert error is None, (ckpt.name, op, message)
            assert peak < 32, (ckpt.name, op, peak)  # MiB
        assert eqxckpt.load(ckpt)["x"].shape == (0, 1 << 46)
        assert eqxckpt.open(ckpt)["x"][:, 5:].get().shape == (0, (1 << 46) - 5)


def test_an_empty_leaf_whose_other_dimensions_overflow_is_refused(tmp_path):
    """Shape [0, 2**31, 2**31, 2**31] holds no element, but numpy cannot make such an
    array: `open`, `load` and `verify` refuse it as a damaged manifest, naming the leaf
    (it was a raw ValueError from `load` and from `verify`, which never raises)."""
    ckpt = tmp_path / "c"
    eqxckpt.save(ckpt, {"x": np.zeros((0, 2, 2, 2), np.uint8)})
    doc = manifest_doc((ckpt / "eqxckpt.json").read_bytes())
    (record,) = [r for r in doc["leaves"] if r["path"] == "x"]
    record["shape"] = [0, 1 << 31, 1 << 31, 1 << 31]
    (ckpt / "eqxckpt.json").write_bytes(crafted_manifest(doc))
    meta = json.loads((ckpt / "x/zarr.json").read_text())
    meta["shape"] = record["shape"]  # the same crafted shape: the two agree
    (ckpt / "x/zarr.json").write_text(json.dumps(meta))
    with pytest.raises(eqxckpt.ManifestError, match="'x'.*absurd number of elements"):
        eqxckpt.load(ckpt)
    report = eqxckpt.verify(ckpt)
    assert not report.ok and "absurd number of elements" in str(report)


def damage_appended(ckpt):
    """A chunk file with 64 MiB appended (sparse: costs no disk)."""
    chunk = ckpt / "w/c/0/0"
    os.truncate(chunk, chunk.stat().st_size + (64 << 20))


def damage_fill_value(ckpt):
    meta = json.loads((ckpt / "w/zarr.json").read_text())
    meta["fill_value"] = "NaN"
    (ckpt / "w/zarr.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage", [damage_appended, damage_fill_value], ids=["64-MiB-appended", "uint8-NaN-fill"])
def test_every_path_gives_one_verdict(tmp_path, damage):
    """load, a whole lazy read, a lazy slice, verify and diff refuse the same damage alike
    (a lazy slice went through TensorStore, which read past appended bytes and refused a
    fill value the others accepted)."""
    ckpt = tmp_path / "c"
    eqxckpt.save(ckpt, {"w": np.arange(48, dtype=np.uint8).reshape(6, 8)})
    eqxckpt.save(tmp_path / "other", {"w": np.ones((6, 8), np.uint8)})
    damage(ckpt)
    outcomes = every_reader(ckpt)
    for name in ("load", "lazy get", "lazy slice"):
        assert isinstance(outcomes[name], eqxckpt.CorruptCheckpointError), (name, outcomes[name])
        assert outcomes[name].leaf_path == "w", name
    assert not outcomes["verify"].ok and outcomes["verify"].problems[0][0] == "w"
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="'w'"):
        eqxckpt.diff(ckpt, tmp_path / "other")
