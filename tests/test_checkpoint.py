import asyncio

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

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
