"""safetensors in and out, with files written and read by the real `safetensors` library."""

import json
import os
import struct

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as stn
from conftest import assert_trees_equal
from hypothesis import given, settings, strategies as st

import eqxckpt
import eqxckpt._formats._safetensors._read as safetensors_module


def make_model(key=None):
    return eqx.nn.MLP(4, 3, 16, 2, key=jax.random.key(0) if key is None else key)


def tensors_of(tree, prefix=""):
    """``{"model.layers.0.weight": array}`` as a PyTorch/HF export would name them."""
    flat, _ = jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))
    out = {}
    for keypath, leaf in flat:
        parts = [str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in keypath]
        out[prefix + ".".join(parts)] = np.asarray(leaf)
    return out


@pytest.fixture
def hf_file(tmp_path):
    model = make_model()
    tensors = tensors_of(model, "model.")
    tensors["model.embedding"] = np.asarray(jax.random.normal(jax.random.key(1), (8, 4)), ml_dtypes.bfloat16)
    tensors["model.positions"] = np.arange(8, dtype=np.int32)
    tensors["opt.mu"] = np.full((512, 64), 0.5, np.float32)  # what a params-only load must not read
    path = tmp_path / "model.safetensors"
    stn.save_file(tensors, str(path), metadata={"source": "test"})
    return path, model, tensors


def test_open_lists_paths_shapes_and_metadata(hf_file):
    path, _, tensors = hf_file
    ckpt = eqxckpt.open(path)
    assert sorted(ckpt.paths) == sorted(name.replace(".", "/") for name in tensors)
    assert ckpt.metadata == {"source": "test"}
    assert ckpt.leaf("model/embedding").describe() == "bfloat16[8,4]"
    np.testing.assert_array_equal(ckpt["model/positions"].get(), np.arange(8, dtype=np.int32))


def test_load_into_arrays_skeletons_at_transforms_and_a_translator(hf_file):
    path, model, tensors = hf_file
    params, static = eqx.partition(model, eqx.is_array)
    # Into real arrays and into a filter_eval_shape skeleton, at="model", bit-exact.
    like = {
        "layers": eqx.filter(model, eqx.is_array).layers,
        "embedding": jnp.zeros((8, 4), jnp.bfloat16),
        "positions": jnp.zeros(8, jnp.int32),
    }
    got = eqxckpt.load(path, like, at="model")
    assert_trees_equal(got["layers"], params.layers)
    np.testing.assert_array_equal(np.asarray(got["embedding"]), tensors["model.embedding"])
    assert got["positions"].dtype == jnp.int32
    skeleton = eqx.filter_eval_shape(lambda: like)
    assert_trees_equal(eqxckpt.load(path, skeleton, at="model"), got)
    # transforms= renames on the way in.
    renamed = {"first_weight": jnp.zeros((16, 4))}
    rules = {"first_weight": eqxckpt.Transform(original_key="layers/0/weight")}
    out = eqxckpt.load(path, renamed, at="model", transforms=rules)
    np.testing.assert_array_equal(np.asarray(out["first_weight"]), tensors["model.layers.0.weight"])
    # A CheckpointTranslator maps HF-style names onto an Equinox module, which then loads strictly.
    translator = eqxckpt.CheckpointTranslator()

    @translator.add(r"model/layers/(\d+)/(weight|bias)")
    def _(opts, key, value, index, name):
        return f"layers/{index}/{name}", value

    @translator.add(r"model/.*|opt/.*")
    def _(opts, key, value):
        return None, None

    restored = eqxckpt.load(translator.apply(eqxckpt.open(path)), eqx.filter_eval_shape(make_model))
    assert_trees_equal(eqx.filter(restored, eqx.is_array), params)
    assert restored.activation is model.activation  # static parts come from the skeleton


def recorded_reads(monkeypatch) -> list[int]:
    """The bytes of each ranged read of a safetensors file from now on, in order."""
    read: list[int] = []
    real = safetensors_module.read_range
    monkeypatch.setattr(
        safetensors_module,
        "read_range",
        lambda file, offset, buffer, name: (read.append(buffer.nbytes), real(file, offset, buffer, name))[1],
    )
    return read


def test_a_partial_load_reads_only_its_bytes(hf_file, monkeypatch):
    path, model, tensors = hf_file
    read = recorded_reads(monkeypatch)
    eqxckpt.load(path, at="model")
    model_bytes = sum(v.nbytes for k, v in tensors.items() if k.startswith("model."))
    assert sum(read) == model_bytes and model_bytes < tensors["opt.mu"].nbytes / 4


def test_a_sharded_huggingface_directory(tmp_path):
    tensors = {f"encoder.block.{i}.layer.0.SelfAttention.q.weight": np.full((4, 4), i, np.float32) for i in range(4)}
    tensors["shared.weight"] = np.arange(24, dtype=np.float32).reshape(6, 4).astype(ml_dtypes.bfloat16)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for shard, members in shards.items():
        stn.save_file({n: tensors[n] for n in members}, str(tmp_path / shard))
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
        "weight_map": {n: shard for shard, members in shards.items() for n in members},
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    ckpt = eqxckpt.open(tmp_path)
    assert ckpt.metadata == index["metadata"] and len(ckpt) == 5
    everything = eqxckpt.load(tmp_path)
    for name, value in tensors.items():
        node = everything
        for part in name.split("."):
            node = node[part]
        np.testing.assert_array_equal(node, value)
        assert node.dtype == value.dtype
    # An index that names a shard outside the directory is refused.
    index["weight_map"][names[0]] = "../elsewhere.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(eqxckpt.ManifestError, match="not a file in"):
        eqxckpt.open(tmp_path)


def test_save_safetensors_loads_in_safetensors_bit_exact(tmp_path):
    model = make_model()
    tree = {
        "model": eqx.filter(model, eqx.is_array),
        "step": np.int64(3),
        "scale": jnp.ones(2, jnp.bfloat16),
        "nan": np.array([np.nan, -0.0, np.inf], np.float32),
    }
    eqxckpt.save_safetensors(tmp_path / "out.safetensors", tree, metadata={"step": "3"})
    loaded = stn.load_file(str(tmp_path / "out.safetensors"))
    expected = {name: value for name, value in tensors_of(tree["model"], "model.").items()}
    expected.update({"step": np.int64(3), "scale": np.ones(2, ml_dtypes.bfloat16), "nan": tree["nan"]})
    assert sorted(loaded) == sorted(expected)
    for name, value in expected.items():
        assert loaded[name].dtype == np.asarray(value).dtype
        assert loaded[name].tobytes() == np.asarray(value).tobytes()
    back = eqxckpt.load(tmp_path / "out.safetensors", eqx.filter(model, eqx.is_array), at="model")
    assert_trees_equal(back, eqx.filter(model, eqx.is_array))
    assert eqxckpt.open(tmp_path / "out.safetensors").metadata == {"step": "3"}


def test_save_safetensors_stores_big_endian_arrays_little_endian(tmp_path):
    # safetensors data are little-endian: big-endian host arrays, and lazy reads cast to a
    # big-endian dtype, are written as the values they hold, not as their raw bytes.
    values = {
        "f4": np.array([1.5, -2.0, np.inf], np.float32),
        "f8": np.array([[np.pi, -0.0]], np.float64),
        "i4": np.array([1, -2, 2**31 - 1], np.int32),
        "u2": np.array([1, 2, 65535], np.uint16),
        "i8": np.array(-(2**40), np.int64),  # 0-d: keeps its shape
        "bf16": np.array([1.5, -2.0], ml_dtypes.bfloat16),
        "f16": np.array([0.5, 65504.0], np.float16),
    }
    big = {name: value.astype(value.dtype.newbyteorder(">")) for name, value in values.items()}
    assert all(big[name].tobytes() != value.tobytes() for name, value in values.items())
    eqxckpt.save_safetensors(tmp_path / "big.safetensors", big)
    eqxckpt.save(tmp_path / "c", values)
    lazy = eqxckpt.open(tmp_path / "c")
    casts = {name: lazy[name].astype(value.dtype.newbyteorder(">")) for name, value in values.items()}
    eqxckpt.save_safetensors(tmp_path / "lazy.safetensors", casts)
    for file in ["big.safetensors", "lazy.safetensors"]:
        loaded = stn.load_file(str(tmp_path / file))
        assert sorted(loaded) == sorted(values)
        for name, value in values.items():
            assert loaded[name].dtype == value.dtype and loaded[name].shape == value.shape
            assert loaded[name].tobytes() == value.tobytes(), (file, name, loaded[name], value)
        back = eqxckpt.load(tmp_path / file)
        assert all(back[name].tobytes() == value.tobytes() for name, value in values.items())


def test_save_safetensors_refuses_ambiguous_names_and_non_arrays(tmp_path):
    with pytest.raises(eqxckpt.PathError, match=r"'a/b' and 'a\.b' would both be the tensor 'a\.b'"):
        eqxckpt.save_safetensors(tmp_path / "a.safetensors", {"a.b": np.ones(2), "a": {"b": np.zeros(2)}})
    with pytest.raises(eqxckpt.CheckpointError, match="not an array"):
        eqxckpt.save_safetensors(tmp_path / "b.safetensors", {"f": jax.nn.relu})
    assert not list(tmp_path.iterdir())


def crafted(tmp_path, header, data=b"", length=None):
    raw = json.dumps(header).encode()
    path = tmp_path / "crafted.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@pytest.mark.parametrize(
    "header, data, length, match",
    [
        (
            {
                "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            None,
            "overlap",
        ),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, None, "outside the 8 bytes"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, None, "spans 8 bytes"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, 1 << 40, "header claims"),
        ({"a": {"dtype": "Q3", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8, None, "unknown dtype"),
        ({"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, b"\0", None, "packed several to a byte"),
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, None, "negative"),
        ({"__metadata__": {"a": 1}}, b"", None, "strings to strings"),
    ],
)
def test_crafted_headers_are_clear_errors(tmp_path, header, data, length, match):
    path = crafted(tmp_path, header, data, length)
    with pytest.raises(eqxckpt.ManifestError, match=match):
        eqxckpt.load(path)


@settings(max_examples=150, deadline=None)
@given(position=st.integers(0, 200), value=st.integers(0, 255))
def test_mutated_headers_fail_only_with_checkpoint_errors(tmp_path_factory, position, value):
    """A byte flipped anywhere in a real file's header: a CheckpointError or the exact values, nothing else."""
    directory = tmp_path_factory.mktemp("mutated")
    tensors = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, ml_dtypes.bfloat16)}
    path = directory / "m.safetensors"
    stn.save_file(tensors, str(path))
    raw = bytearray(path.read_bytes())
    raw[position % len(raw)] = value
    path.write_bytes(bytes(raw))
    try:
        got = eqxckpt.load(path)
    except eqxckpt.CheckpointError:
        return
    for name in got:
        assert got[name].shape == tensors.get(name, got[name]).shape


def test_a_pytorch_pickle_is_refused_with_how_to_convert(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"PK\x03\x04" + b"\0" * 64)
    for where in (tmp_path / "pytorch_model.bin", tmp_path):
        with pytest.raises(eqxckpt.UnsupportedFormatError, match="pickle.*never does.*safetensors"):
            eqxckpt.load(where)
    (tmp_path / "weights.pt").write_bytes(b"\x80\x02}q\x00.")
    with pytest.raises(eqxckpt.UnsupportedFormatError, match="pickle"):
        eqxckpt.open(tmp_path / "weights.pt")
    with pytest.raises(eqxckpt.UnsupportedFormatError, match="Unknown format"):
        eqxckpt.open(tmp_path, format="pickle")


def test_saving_an_opened_safetensors_tree_copies_it_into_eqxckpt_and_back(hf_file, tmp_path):
    """save(dst, open(src).tree()) copies lazily, tensor by tensor; save_safetensors of a lazy tree too."""
    path, _, tensors = hf_file
    eqxckpt.save(tmp_path / "eqx", eqxckpt.open(path).tree(), metadata={"from": "hf"})
    copied = eqxckpt.open(tmp_path / "eqx")
    assert sorted(copied.paths) == sorted(eqxckpt.open(path).paths)
    for name, value in tensors.items():
        got = copied[name.replace(".", "/")].get()
        assert got.dtype == value.dtype and got.tobytes() == value.tobytes()
    eqxckpt.save_safetensors(tmp_path / "again.safetensors", copied.tree())
    again = stn.load_file(str(tmp_path / "again.safetensors"))
    assert {k: v.tobytes() for k, v in again.items()} == {k: v.tobytes() for k, v in tensors.items()}


def test_save_safetensors_never_replaces_a_file_unless_asked(tmp_path):
    target = tmp_path / "weights.safetensors"
    target.write_bytes(b"someone else's file")
    with pytest.raises(eqxckpt.CheckpointExistsError, match="overwrite=True"):
        eqxckpt.save_safetensors(target, {"w": np.ones(3, np.float32)})
    assert target.read_bytes() == b"someone else's file"
    eqxckpt.save_safetensors(target, {"w": np.ones(3, np.float32)}, overwrite=True)
    np.testing.assert_array_equal(stn.load_file(str(target))["w"], np.ones(3, np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.safetensors"]  # no temporary file left


def test_a_file_replaced_while_open_is_read_whole_from_the_version_opened(tmp_path):
    """Every tensor comes from the file whose header was validated, never a mix of two versions."""
    path = tmp_path / "m.safetensors"
    stn.save_file({"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}, str(path))
    ckpt = eqxckpt.open(path)
    first = ckpt["a"].get()
    eqxckpt.save_safetensors(path, {"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)}, overwrite=True)
    np.testing.assert_array_equal(first, np.zeros(4, np.float32))
    np.testing.assert_array_equal(ckpt["b"].get(), np.zeros(4, np.float32))  # the old version, not the new
    np.testing.assert_array_equal(eqxckpt.load(path)["b"], np.ones(4, np.float32))  # a new open sees the new one


def raw_file(path, header: dict | str, data: bytes = b"") -> None:
    """A safetensors file with exactly this header text (a dict is dumped as JSON)."""
    raw = (header if isinstance(header, str) else json.dumps(header)).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_a_name_that_is_a_tensor_and_a_subtree_is_refused_naming_both(tmp_path, capsys):
    # "a-x" sorts between "a" and "a/c", which hid the clash from a check of neighbours.
    path = tmp_path / "clash.safetensors"
    stn.save_file(
        {"a.c": np.ones(1, np.float32), "a": np.full(1, 2, np.float32), "a-x": np.full(1, 3, np.float32)}, str(path)
    )
    for attempt in (lambda: eqxckpt.open(path), lambda: eqxckpt.load(path)):
        with pytest.raises(eqxckpt.ManifestError, match=r"'a' is a tensor and also holds 'a\.c'"):
            attempt()
    from eqxckpt._cli import main

    assert main(["convert", str(path), str(tmp_path / "out")]) == 1
    assert "'a' is a tensor and also holds 'a.c'" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_zero_dimensional_leaves_keep_their_shape(tmp_path):
    tree = {"a": np.float32(3.5), "b": np.array(2.0), "c": jnp.float32(1.5), "d": np.arange(3)}
    eqxckpt.save_safetensors(tmp_path / "z.safetensors", tree)
    theirs = stn.load_file(str(tmp_path / "z.safetensors"))
    assert {k: v.shape for k, v in theirs.items()} == {"a": (), "b": (), "c": (), "d": (3,)}
    ours = eqxckpt.load(tmp_path / "z.safetensors")
    assert {k: np.shape(v) for k, v in ours.items()} == {"a": (), "b": (), "c": (), "d": (3,)}
    assert float(ours["a"]) == 3.5 and ours["b"].dtype == np.float64
    # Through convert: an eqxckpt checkpoint's 0-d leaves, lazily copied.
    eqxckpt.save(tmp_path / "ckpt", tree)
    eqxckpt.save_safetensors(tmp_path / "copy.safetensors", eqxckpt.open(tmp_path / "ckpt").tree())
    assert {k: v.shape for k, v in stn.load_file(str(tmp_path / "copy.safetensors")).items()}["a"] == ()


def test_reserved_and_duplicate_tensor_names_are_refused(tmp_path):
    with pytest.raises(eqxckpt.PathError, match="'__metadata__'"):
        eqxckpt.save_safetensors(tmp_path / "m.safetensors", {"__metadata__": np.ones(2)})
    assert not list(tmp_path.iterdir())
    entry = '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    raw_file(tmp_path / "dup.safetensors", f'{{"a": {entry}, "a": {entry}}}', b"\0" * 4)
    with pytest.raises(eqxckpt.ManifestError, match="names 'a' twice"):
        eqxckpt.open(tmp_path / "dup.safetensors")


def test_prng_keys_are_refused_by_name(tmp_path, capsys):
    tree = {"params": {"w": np.ones(2)}, "rng": jax.random.key(0)}
    with pytest.raises(eqxckpt.UnsupportedLeafError, match="Leaf 'rng' is a typed PRNG key"):
        eqxckpt.save_safetensors(tmp_path / "k.safetensors", tree)
    eqxckpt.save(tmp_path / "ckpt", tree)
    from eqxckpt._cli import main

    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "k.safetensors"), "--to", "safetensors"]) == 1
    assert "Leaf 'rng' is a typed PRNG key" in capsys.readouterr().err
    assert not (tmp_path / "k.safetensors").exists()


def test_a_bool_byte_other_than_0_or_1_is_refused(tmp_path):
    raw_file(
        tmp_path / "b.safetensors", {"x": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]}}, b"\x01\x02\x00"
    )
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="Leaf 'x': its bool data holds bytes other than 0 and 1"):
        eqxckpt.load(tmp_path / "b.safetensors")
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="bool data"):
        eqxckpt.open(tmp_path / "b.safetensors")["x"].get()
    raw_file(
        tmp_path / "ok.safetensors", {"x": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]}}, b"\x01\x00\x01"
    )
    assert eqxckpt.load(tmp_path / "ok.safetensors")["x"].tolist() == [True, False, True]


def test_fifos_and_symlinks_in_a_directory_are_refused_without_hanging(tmp_path):
    from conftest import release_fifo, returns_within

    directory = tmp_path / "sharded"
    directory.mkdir()
    stn.save_file({"a": np.ones(2, np.float32)}, str(directory / "one.safetensors"))
    os.mkfifo(directory / "two.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}
    (directory / "real_index.json").write_text(json.dumps(index))
    (directory / "model.safetensors.index.json").symlink_to(directory / "real_index.json")
    with pytest.raises(eqxckpt.ManifestError, match="symlink or special file"):
        returns_within(lambda: eqxckpt.open(directory), release=lambda: release_fifo(directory / "two.safetensors"))
    (directory / "model.safetensors.index.json").unlink()
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(eqxckpt.ManifestError, match="not a regular file"):
        returns_within(lambda: eqxckpt.open(directory), release=lambda: release_fifo(directory / "two.safetensors"))


@pytest.mark.multiprocess
def test_a_killed_writers_temporary_file_is_removed_by_the_next_write(tmp_path):
    from conftest import kill_when

    final = tmp_path / "big.safetensors"
    script = f"""
import numpy as np, eqxckpt
eqxckpt.save_safetensors({str(final)!r}, {{f"w{{i}}": np.ones(1 << 22, np.float32) for i in range(64)}})
"""
    kill_when(script, lambda: any(p.name.startswith(".big.safetensors.eqxckpt-tmp-") for p in tmp_path.iterdir()))
    assert [p.name for p in tmp_path.iterdir()][0].startswith(".big.safetensors.eqxckpt-tmp-")
    os.mkfifo(tmp_path / ".big.safetensors.eqxckpt-tmp-0123456789ab")  # not a file eqxckpt writes: left alone
    (tmp_path / ".other.safetensors.eqxckpt-tmp-0123456789ab").write_bytes(b"another file's")
    eqxckpt.save_safetensors(final, {"w": np.ones(2, np.float32)})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".big.safetensors.eqxckpt-tmp-0123456789ab",
        ".other.safetensors.eqxckpt-tmp-0123456789ab",
        "big.safetensors",
    ]


def test_a_header_of_many_tiny_tensors_is_refused_before_it_is_parsed(tmp_path):
    import tracemalloc

    count = 300_000  # a 20.6 MB header; loading it took about 460 MB (22x)
    header = {f"t{i}": {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(count)}
    raw_file(tmp_path / "dense.safetensors", json.dumps(header, separators=(",", ":")), b"\0" * 4 * count)
    del header
    tracemalloc.start()
    try:
        with pytest.raises(eqxckpt.ManifestError, match="declares up to 300000 tensors"):
            eqxckpt.load(tmp_path / "dense.safetensors")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * (tmp_path / "dense.safetensors").stat().st_size, peak
    # A real model's many tensors, with real names, load.
    names = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(500) for p in "qkvo"]
    stn.save_file({name: np.ones(2, np.float32) for name in names}, str(tmp_path / "real.safetensors"))
    assert len(eqxckpt.open(tmp_path / "real.safetensors")) == 2000


@pytest.fixture(scope="module")
def sliced_file(tmp_path_factory):
    """A file of tensors of several ranks and dtypes, to slice lazily."""
    rng = np.random.default_rng(0)
    tensors = {
        "m": rng.standard_normal((7, 5)).astype(np.float32),
        "t": rng.integers(-100, 100, (4, 3, 6)).astype(np.int16),
        "v": np.arange(9, dtype=np.float64),
        "b": np.arange(8, dtype=np.float32).reshape(2, 4).astype(ml_dtypes.bfloat16),
        "s": np.array(3.5, np.float32),
        "e": np.zeros((0, 3), np.float32),
    }
    path = tmp_path_factory.mktemp("sliced") / "m.safetensors"
    stn.save_file(tensors, str(path))
    return path, tensors


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_lazy_slices_and_casts_match_numpy(sliced_file, data):
    """A safetensors leaf is an `eqxckpt.LazyArray`: any basic index and a cast are deferred,
    and give what numpy gives; a save copies the slice part by part."""
    import hypothesis.extra.numpy as hnp

    path, tensors = sliced_file
    source = eqxckpt.open(path)
    name = data.draw(st.sampled_from(sorted(tensors)))
    whole = tensors[name]
    lazy = source[name]
    assert isinstance(lazy, eqxckpt.LazyArray)
    index = data.draw(hnp.basic_indices(whole.shape, allow_newaxis=True, allow_ellipsis=True))
    expected = whole[index]
    view = lazy[index]
    assert view.shape == expected.shape and view.dtype == expected.dtype
    got = view.get()
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)
    cast = view.astype(np.float32)
    assert cast.dtype == np.float32
    np.testing.assert_array_equal(cast.get(), np.asarray(expected).astype(np.float32))
    if expected.ndim:
        part = tuple(slice(0, max(1, n // 2)) if n else slice(0, 0) for n in expected.shape)
        np.testing.assert_array_equal(view.part_reader()(part), expected[part])


def test_a_lazy_slice_reads_only_the_rows_it_needs(sliced_file, monkeypatch):
    path, tensors = sliced_file
    source = eqxckpt.open(path)
    reads = recorded_reads(monkeypatch)
    np.testing.assert_array_equal(source["m"][2:4, 1].get(), tensors["m"][2:4, 1])
    assert reads == [2 * 5 * 4]  # rows 2 and 3, whole
    np.testing.assert_array_equal(source["m"][5:2:-2].get(), tensors["m"][5:2:-2])
    assert reads[1:] == [3 * 5 * 4]  # rows 3 to 5


def test_a_lazy_slice_of_a_safetensors_file_saves_into_either_format(sliced_file, tmp_path):
    path, tensors = sliced_file
    source = eqxckpt.open(path)
    tree = {"rows": source["m"][1:6:2], "half": source["t"][:, 1].astype(np.float32), "whole": source["v"]}
    eqxckpt.save(tmp_path / "ckpt", tree)
    back = eqxckpt.load(tmp_path / "ckpt")
    np.testing.assert_array_equal(back["rows"], tensors["m"][1:6:2])
    np.testing.assert_array_equal(back["half"], tensors["t"][:, 1].astype(np.float32))
    np.testing.assert_array_equal(back["whole"], tensors["v"])
    assert eqxckpt.open(tmp_path / "ckpt").leaf("half").describe() == "float32[4,6]"
    eqxckpt.save_safetensors(tmp_path / "again.safetensors", tree)
    again = stn.load_file(str(tmp_path / "again.safetensors"))
    np.testing.assert_array_equal(again["rows"], tensors["m"][1:6:2])
    np.testing.assert_array_equal(again["half"], tensors["t"][:, 1].astype(np.float32))


def test_save_safetensors_makes_its_parents_as_save_does(tmp_path):
    """#53 item 6: a bare FileNotFoundError naming its temporary file, where `save` makes
    the parents; a parent that is a file is a CheckpointWriteError naming it."""
    tree = {"w": np.arange(3, dtype=np.float32)}
    target = tmp_path / "new" / "deeper" / "model.safetensors"
    eqxckpt.save_safetensors(target, tree)
    assert stn.load_file(str(target))["w"].tolist() == [0.0, 1.0, 2.0]
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(eqxckpt.CheckpointWriteError, match=r"a-file.*Nothing was written"):
        eqxckpt.save_safetensors(tmp_path / "a-file" / "model.safetensors", tree)
    assert (tmp_path / "a-file").read_text() == "x"


def test_a_0d_tensor_reads_into_a_buffer(tmp_path):
    stn.save_file({"z": np.asarray(np.float32(5))}, str(tmp_path / "m.safetensors"))
    source = eqxckpt.open(tmp_path / "m.safetensors")
    out = np.empty((), np.float32)
    source.read_into(source.leaf("z"), (), out)
    assert float(out) == 5.0


@pytest.mark.parametrize(
    "index", [np.s_[::3, 1], np.s_[5:9000:7], np.s_[:, 0], np.s_[9999:0:-13, ::2], np.s_[4000:4001], np.s_[::2]]
)
def test_parts_of_rows_read_a_window_of_rows_at_a_time_match_numpy(tmp_path, index):
    # Columns and strided rows are read a window of whole rows at a time, each row once:
    # a budget of a few rows makes hundreds of windows.
    from eqxckpt._window import limited_host_memory

    x = np.random.default_rng(0).standard_normal((10_000, 4)).astype(np.float32)
    stn.save_file({"x": x}, str(tmp_path / "m.safetensors"))
    source = eqxckpt.open(tmp_path / "m.safetensors")
    with limited_host_memory(4096):
        np.testing.assert_array_equal(source["x"][index].get(), x[index])


def test_every_dtype_safetensors_holds_one_a_byte_or_more_round_trips(tmp_path):
    """complex64 and float8_e8m0fnu (MX scales) out and back bit for bit; the library
    itself reads the complex64 file and accepts the F8_E8M0 header."""
    from safetensors import safe_open

    tensors = {
        "c": np.array([1 + 2j, -0.5j], np.complex64),
        "scale": np.array([2.0**-10, 1.0, 2.0**7, np.nan], ml_dtypes.float8_e8m0fnu),
    }
    eqxckpt.save_safetensors(tmp_path / "m.safetensors", tensors)
    back = eqxckpt.load(tmp_path / "m.safetensors")
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and back[name].tobytes() == value.tobytes()
    raw = (tmp_path / "m.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    assert header["scale"]["dtype"] == "F8_E8M0" and header["c"]["dtype"] == "C64"
    with safe_open(str(tmp_path / "m.safetensors"), "numpy") as f:
        assert set(f.keys()) == {"c", "scale"}
        np.testing.assert_array_equal(f.get_tensor("c"), tensors["c"])


@pytest.mark.parametrize("name", ["float4_e2m1fn", "uint4", "int2"])
def test_a_dtype_safetensors_cannot_hold_one_a_byte_is_refused_naming_it(tmp_path, name):
    with pytest.raises(eqxckpt.CheckpointError, match=f"'w' has dtype {name}.*eqxckpt.save"):
        eqxckpt.save_safetensors(tmp_path / "m.safetensors", {"w": np.zeros(4, np.dtype(name))})
    assert not (tmp_path / "m.safetensors").exists()
