"""Orbax checkpoints, written by the real `orbax-checkpoint`, read without importing it."""

import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import assert_trees_equal

import eqxckpt


def make_model(key=None):
    return eqx.nn.MLP(4, 3, 16, 2, key=jax.random.key(0) if key is None else key)


def state():
    params = eqx.filter(make_model(), eqx.is_array)
    opt = optax.adam(1e-3).init(params)
    extra = {
        "embedding": jnp.arange(12.0).reshape(3, 4).astype(jnp.bfloat16),
        "positions": jnp.arange(5, dtype=jnp.int32),
    }
    return {"params": params, "opt": opt, "extra": extra, "step": 7, "lr": 0.25}


@pytest.fixture(scope="module", params=["ocdbt", "per-leaf"])
def orbax_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("orbax") / "ckpt"
    tree = state()
    if request.param == "ocdbt":
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(os.fspath(path), tree)
        checkpointer.wait_until_finished()
    else:
        ocp.PyTreeCheckpointer(use_ocdbt=False).save(os.fspath(path), tree)
    return path, tree


def test_open_and_load_everything_bit_exact(orbax_dir):
    path, tree = orbax_dir
    ckpt = eqxckpt.open(path)
    assert "params/layers/0/weight" in ckpt.paths and ckpt.leaf("extra/embedding").describe() == "bfloat16[3,4]"
    assert ckpt["step"] == 7 and ckpt["lr"] == 0.25
    like = jax.tree_util.tree_map(lambda x: x, tree)
    restored = eqxckpt.load(path, like)
    assert_trees_equal(restored, tree)
    skeleton = eqx.filter_eval_shape(state)
    assert_trees_equal(eqxckpt.load(path, skeleton), tree)


def test_params_only_transforms_and_a_translator(orbax_dir):
    path, tree = orbax_dir
    model = eqxckpt.load(path, eqx.filter_eval_shape(make_model), at="params")
    assert_trees_equal(eqx.filter(model, eqx.is_array), tree["params"])
    assert model.activation is make_model().activation
    rules = {"first": eqxckpt.Transform(original_key="params/layers/0/weight")}
    got = eqxckpt.load(path, {"first": jnp.zeros((16, 4))}, transforms=rules)
    np.testing.assert_array_equal(np.asarray(got["first"]), np.asarray(tree["params"].layers[0].weight))
    translator = eqxckpt.CheckpointTranslator()

    @translator.add(r"params/(.*)")
    def _(opts, key, value, rest):
        return f"model/{rest}", value

    @translator.add(r".*")
    def _(opts, key, value):
        return None, None

    view = translator.apply(eqxckpt.open(path))
    again = eqxckpt.load(view, eqx.filter_eval_shape(make_model), at="model")
    assert_trees_equal(eqx.filter(again, eqx.is_array), tree["params"])


def test_crafted_metadata_and_symlinks_are_refused(tmp_path):
    path = tmp_path / "ckpt"
    ocp.PyTreeCheckpointer(use_ocdbt=False).save(os.fspath(path), {"w": np.arange(3.0)})
    doc = json.loads((path / "_METADATA").read_text())
    [entry] = doc["tree_metadata"].values()
    entry["key_metadata"][0]["key"] = "../outside"
    (path / "_METADATA").write_text(json.dumps({**doc, "tree_metadata": {"x": entry}}))
    with pytest.raises(eqxckpt.ManifestError, match="will not use as a storage path"):
        eqxckpt.open(path, format="orbax")
    other = tmp_path / "other"
    ocp.PyTreeCheckpointer(use_ocdbt=False).save(os.fspath(other), {"w": np.arange(3.0)})
    (other / "w").rename(tmp_path / "elsewhere")
    (other / "w").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(eqxckpt.ManifestError, match="symlink"):
        eqxckpt.load(other)


def test_a_chunk_larger_than_its_array_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    ocp.PyTreeCheckpointer(use_ocdbt=False).save(os.fspath(path), {"w": np.arange(3.0)})
    zarray = json.loads((path / "w/.zarray").read_text())
    (path / "w/.zarray").write_text(json.dumps({**zarray, "chunks": [1 << 30]}))
    with pytest.raises(eqxckpt.ManifestError, match="larger than its shape"):
        eqxckpt.open(path)


def test_a_checkpoint_replaced_after_open_is_never_read_as_a_mix(tmp_path):
    path = tmp_path / "ckpt"
    ocp.PyTreeCheckpointer(use_ocdbt=False).save(os.fspath(path), {"a": np.zeros(3), "b": np.zeros(3)})
    opened = eqxckpt.open(path)
    path.rename(tmp_path / "old")  # another job rewrites the checkpoint at that path
    ocp.PyTreeCheckpointer(use_ocdbt=False).save(os.fspath(path), {"a": np.ones(3), "b": np.ones(3)})
    with pytest.raises(eqxckpt.CheckpointChangedError, match="replaced or deleted"):
        eqxckpt.load(opened)
    np.testing.assert_array_equal(eqxckpt.load(path)["b"], np.ones(3))


def _edited(tmp_path, tree, edit_keys, renames):
    """A per-leaf Orbax checkpoint of ``tree`` whose _METADATA keys are changed by
    ``edit_keys(key_metadata)`` and whose leaf directories are renamed as ``renames`` says."""
    path = tmp_path / "ckpt"
    ocp.PyTreeCheckpointer(use_ocdbt=False).save(os.fspath(path), tree)
    doc = json.loads((path / "_METADATA").read_text())
    for entry in doc["tree_metadata"].values():
        edit_keys(entry["key_metadata"])
    (path / "_METADATA").write_text(json.dumps(doc))
    for old, new in renames.items():
        (path / old).rename(path / new)
    return path


def _rename_key(old, new):
    def edit(keys):
        for key in keys:
            if key["key"] == old:
                key["key"] = new

    return edit


def test_a_name_that_is_a_leaf_and_a_subtree_is_refused(tmp_path):
    path = _edited(tmp_path, {"a": np.full(1, 2.0), "b": {"c": np.ones(1)}}, _rename_key("b", "a"), {"b.c": "a.c"})
    with pytest.raises(eqxckpt.ManifestError, match=r"'a' is a tensor and also holds 'a\.c'"):
        eqxckpt.open(path)


def test_a_huge_sequence_index_allocates_nothing(tmp_path):
    import tracemalloc

    path = _edited(tmp_path, {"a": [np.ones(2)]}, _rename_key("0", "900000000"), {"a.0": "a.900000000"})
    tracemalloc.start()
    try:
        with pytest.raises(eqxckpt.ManifestError, match=r"sequence at 'a' has items \[900000000\]"):
            eqxckpt.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak  # the list it would have made is 7.2 GB


@pytest.mark.parametrize("index", ["²", "٣", "1" * 30])
def test_a_sequence_index_that_is_not_ascii_digits_is_refused(tmp_path, index):
    path = _edited(tmp_path, {"a": [np.ones(2)]}, _rename_key("0", index), {})
    with pytest.raises(eqxckpt.ManifestError, match="is not a number"):
        eqxckpt.open(path)


def test_a_fifo_in_place_of_a_chunk_is_refused_without_hanging(tmp_path):
    from conftest import release_fifo, returns_within

    path = tmp_path / "ckpt"
    ocp.PyTreeCheckpointer(use_ocdbt=False).save(os.fspath(path), {"w": np.arange(3.0)})
    [chunk] = [p for p in (path / "w").iterdir() if not p.name.startswith(".")]
    chunk.unlink()
    os.mkfifo(chunk)
    with pytest.raises(eqxckpt.ManifestError, match="not a plain file or directory"):
        returns_within(lambda: eqxckpt.load(path), release=lambda: release_fifo(chunk))


def test_orbax_leaves_are_lazy_arrays_that_slice_and_cast(orbax_dir):
    path, tree = orbax_dir
    ckpt = eqxckpt.open(path)
    embedding = np.asarray(tree["extra"]["embedding"])
    lazy = ckpt["extra/embedding"]
    assert isinstance(lazy, eqxckpt.LazyArray) and lazy.shape == (3, 4)
    np.testing.assert_array_equal(lazy[1:, ::2].get(), embedding[1:, ::2])
    np.testing.assert_array_equal(lazy[-1].astype(np.float32).get(), embedding[-1].astype(np.float32))
    positions = ckpt["extra/positions"][None, 3:]
    assert positions.shape == (1, 2)
    np.testing.assert_array_equal(positions.get(), np.arange(5, dtype=np.int32)[None, 3:])
    weight = np.asarray(tree["params"].layers[0].weight)
    np.testing.assert_array_equal(ckpt["params/layers/0/weight"][..., 0].get(), weight[..., 0])
