import asyncio
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import manifest_doc
from hypothesis import given, settings, strategies as st

import eqxckpt


@pytest.fixture
def ckpt(tmp_path):
    tree = {
        "model": {"w": np.arange(24, dtype=np.float32).reshape(4, 6), "b": jnp.ones(6, jnp.bfloat16)},
        "key": jax.random.key(3),
        "step": 12,
        "fn": jax.nn.relu,
    }
    eqxckpt.save(tmp_path / "c", tree, metadata={"lr": 0.1})
    return eqxckpt.open(tmp_path / "c"), tree


def test_description_without_reading(ckpt):
    c, _ = ckpt
    assert c.paths == ["fn", "key", "model/b", "model/w", "step"]
    assert c.metadata == {"lr": 0.1}
    w = c["model/w"]
    assert isinstance(w, eqxckpt.LazyArray)
    assert (w.shape, w.dtype, w.nbytes, w.ndim) == ((4, 6), np.dtype(np.float32), 96, 2)
    assert c["model/b"].dtype == ml_dtypes.bfloat16
    assert c.leaf("model/w").kind == "array" and c.leaf("fn").kind == "opaque" and c.leaf("step").kind == "scalar"
    assert c.nbytes == 96 + 12 + 8
    assert c["step"] == 12 and "model/w" in c and len(c) == 5


def test_get_slice_cast_async(ckpt):
    c, tree = ckpt
    w = c["model/w"]
    np.testing.assert_array_equal(w.get(), tree["model"]["w"])
    np.testing.assert_array_equal(np.asarray(w), tree["model"]["w"])
    part = w[1:3, ::2]
    assert part.shape == (2, 3)
    np.testing.assert_array_equal(part.get(), tree["model"]["w"][1:3, ::2])
    as_int = w.astype(np.int16)
    assert as_int.dtype == np.int16 and as_int.nbytes == 48
    assert as_int.get().dtype == np.int16
    got = asyncio.run(c["model/b"].get_async())
    np.testing.assert_array_equal(got, np.ones(6, ml_dtypes.bfloat16))
    key = c["key"].get()
    assert jax.random.key_data(key).tolist() == jax.random.key_data(tree["key"]).tolist()


def test_tree_and_subtrees(ckpt):
    c, _ = ckpt
    sub = c.tree(at="model")
    assert set(sub) == {"w", "b"} and isinstance(sub["w"], eqxckpt.LazyArray)
    assert set(c["model"]) == {"w", "b"}
    full = c.tree()
    assert full["step"] == 12 and full["fn"] is None


def test_unknown_leaf_suggests(ckpt):
    c, _ = ckpt
    with pytest.raises(KeyError, match="model/w"):
        c["model/ww"]


SLICED = {  # small chunks (CHUNK_BYTES 64: 16 float32), so a selection spans and skips chunks
    "v": np.arange(37, dtype=np.float32),
    "m": np.arange(63, dtype=np.float32).reshape(9, 7),
    "t": np.arange(120, dtype=np.int16).reshape(5, 4, 6),
    "s": np.float32(2.5),
}


@pytest.fixture(scope="module")
def sliced(tmp_path_factory):
    import eqxckpt._chunks as chunks_module

    path = tmp_path_factory.mktemp("sliced") / "c"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chunks_module, "CHUNK_BYTES", 64)
        eqxckpt.save(path, {**SLICED, "many": np.arange(4096, dtype=np.float32).reshape(64, 64)})
    return eqxckpt.open(path)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_lazy_slices_equal_numpy_slices_of_the_loaded_array(sliced, data):
    """Any basic index (ints, slices with any step, ..., None) read lazily, through the
    chunks that hold it, is what numpy gives for the loaded array; a part of a selection
    (what a copy reads a chunk at a time) too."""
    import hypothesis.extra.numpy as hnp

    name = data.draw(st.sampled_from(["v", "m", "t", "s", "many"]))
    whole = sliced[name].get()
    index = data.draw(hnp.basic_indices(whole.shape, allow_newaxis=True, allow_ellipsis=True))
    lazy = sliced[name][index]
    expected = whole[index]
    assert lazy.shape == expected.shape
    got = lazy.get()
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)
    if expected.ndim:
        part = tuple(slice(0, max(1, n // 2)) if n else slice(0, 0) for n in expected.shape)
        np.testing.assert_array_equal(lazy.part_reader()(part), expected[part])


def test_lazy_indices_numpy_refuses_are_refused_at_once(sliced):
    with pytest.raises(IndexError):
        sliced["m"][9]
    with pytest.raises(IndexError):
        sliced["m"][0, 0, 0]
    with pytest.raises(NotImplementedError, match="basic indices"):
        sliced["m"][[0, 1]]
    np.testing.assert_array_equal(sliced["m"][np.int64(-1)].get(), SLICED["m"][-1])


def test_location_is_the_path_as_a_string_for_every_format(tmp_path):
    import safetensors.numpy

    from eqxckpt._storage import Storage

    eqxckpt.save(tmp_path / "c", {"w": np.ones(2)})
    safetensors.numpy.save_file({"w": np.ones(2)}, str(tmp_path / "m.safetensors"))
    ckpt = eqxckpt.open(tmp_path / "c")
    assert ckpt.location == str(tmp_path / "c") and isinstance(ckpt.stored.storage, Storage)
    assert eqxckpt.open(tmp_path / "m.safetensors").location == str(tmp_path / "m.safetensors")
    assert repr(ckpt) == f"Checkpoint({str(tmp_path / 'c')!r}, 1 leaves, 16 bytes)"


def test_a_parts_lazy_reads_outside_its_blocks_are_refused_even_with_files_there(tmp_path, monkeypatch, capsys):
    """A part (a local tier's) holds some blocks of a leaf; a read of any other box is an
    `ArgumentError` naming them, whether by `open(...)[...]`, a save copying the leaf, or
    a chunk file crafted where the part holds none: never zeros, never the crafted bytes."""

    from conftest import crafted_manifest

    monkeypatch.setattr("eqxckpt._chunks.CHUNK_BYTES", 8192)  # chunks of 2 rows
    w = np.arange(8 * 1024, dtype=np.float32).reshape(8, 1024)
    eqxckpt.save(tmp_path / "c", {"w": w})
    assert sorted(p.name for p in (tmp_path / "c/w/c").iterdir()) == ["0", "1", "2", "3"]
    doc = manifest_doc((tmp_path / "c/eqxckpt.json").read_text())
    [leaf] = doc["leaves"]
    leaf["blocks"] = [[[2, 4], [0, 1024]]]
    del leaf["digest"]
    (tmp_path / "c/eqxckpt.json").write_bytes(crafted_manifest(doc))
    for row in ("2", "3"):  # rows 0-2 keep a (crafted) chunk file
        shutil.rmtree(tmp_path / "c/w/c" / row)
    ckpt = eqxckpt.open(tmp_path / "c")
    assert np.array_equal(ckpt["w"][2:4].get(), w[2:4]) and np.array_equal(ckpt["w"][3, 5:9].get(), w[3, 5:9])
    for outside in (np.s_[0:2], np.s_[1:3], np.s_[:], np.s_[5]):
        with pytest.raises(eqxckpt.ArgumentError, match=r"'w'.*holds only blocks \[2:4, 0:1024\]"):
            ckpt["w"][outside].get()
    with pytest.raises(eqxckpt.CheckpointError, match=r"holds only blocks"):
        eqxckpt.save(tmp_path / "copy", ckpt.tree())
    assert not (tmp_path / "copy").exists()
    # `eqxckpt inspect` shows what the part holds.
    from eqxckpt._cli import main

    assert main(["inspect", str(tmp_path / "c")]) == 0
    assert "w  float32[8,1024]  8.0 KiB  holds [2:4, 0:1024]" in capsys.readouterr().out


def test_a_lazy_read_of_a_whole_leaf_checks_its_digest(tmp_path):
    """Chunks swapped between two leaves pass their checksums: a lazy read of all of a leaf
    (`get`, a region holding all of it) checks the leaf's digest, as a load does."""
    eqxckpt.save(tmp_path / "c", {"p": np.zeros((300, 300), np.float32), "q": np.ones((300, 300), np.float32)})
    p, q = tmp_path / "c/p/c/0/0", tmp_path / "c/q/c/0/0"
    p_bytes, q_bytes = p.read_bytes(), q.read_bytes()
    p.write_bytes(q_bytes)
    q.write_bytes(p_bytes)
    ckpt = eqxckpt.open(tmp_path / "c")
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="'p'.*not the bytes saved"):
        ckpt["p"].get()
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="'q'.*not the bytes saved"):
        ckpt["q"][:, :].get()
    p.write_bytes(p_bytes)
    q.write_bytes(q_bytes)
    np.testing.assert_array_equal(eqxckpt.open(tmp_path / "c")["q"].get(), np.ones((300, 300), np.float32))


def test_every_read_of_all_of_a_leaf_checks_its_digest(tmp_path):
    """Reversed, or into a caller's buffer: a read of every element of a leaf is checked
    against its digest, as `get` is (both returned the swapped leaf's bytes)."""
    a = np.arange(90000, dtype=np.float32).reshape(300, 300)
    eqxckpt.save(tmp_path / "c", {"a": a, "b": -a})
    p, q = tmp_path / "c/a/c/0/0", tmp_path / "c/b/c/0/0"
    p_bytes, q_bytes = p.read_bytes(), q.read_bytes()
    p.write_bytes(q_bytes)
    q.write_bytes(p_bytes)
    ckpt = eqxckpt.open(tmp_path / "c")
    for read in (lambda: ckpt["a"][::-1].get(), lambda: ckpt["a"][::-1, ::-1].get()):
        with pytest.raises(eqxckpt.CorruptCheckpointError, match="'a'.*not the bytes saved"):
            read()
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="'a'.*not the bytes saved"):
        ckpt.read_into(ckpt.leaf("a"), (slice(0, 300), slice(0, 300)), np.empty((300, 300), np.float32))
    p.write_bytes(p_bytes)
    q.write_bytes(q_bytes)
    np.testing.assert_array_equal(eqxckpt.open(tmp_path / "c")["a"][::-1].get(), a[::-1])
