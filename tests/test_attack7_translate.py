"""A translated view of 64-bit data saved from JAX, read with x64 off (attack 7)."""

import jax
import numpy as np
import pytest

import eqxckpt
from eqxckpt._translate import Transposed

BIG = (2**40 + np.arange(6)).reshape(2, 3)


def _view(tmp_path):
    with jax.enable_x64(True):
        eqxckpt.save(tmp_path / "c", {"w": jax.numpy.asarray(BIG)})
    assert not jax.config.read("jax_enable_x64")
    t = eqxckpt.CheckpointTranslator()
    t.add(r"w")(lambda opts, key, value: ("t", Transposed(value)))
    return t.apply(eqxckpt.open(tmp_path / "c"))


def test_a_transposed_leaf_loads_into_numpy_without_narrowing(tmp_path):
    # numpy targets hold 64-bit data whatever x64 says: nothing to refuse, nothing to narrow.
    got = eqxckpt.load(_view(tmp_path), {"t": np.zeros((3, 2), np.int64)})
    np.testing.assert_array_equal(got["t"], BIG.T)
    view = _view(tmp_path / "again")
    (value,) = view.read([(view.leaf("t"), np.zeros((3, 2), np.int64))])
    np.testing.assert_array_equal(value, BIG.T)


def test_a_transposed_leaf_read_into_jax_is_refused_not_narrowed(tmp_path):
    view = _view(tmp_path)
    with pytest.raises(eqxckpt.CastError, match=r"t: int64 would become int32"):
        view.read([(view.leaf("t"), None)])


def test_a_computed_leaf_read_into_jax_is_refused_not_narrowed(tmp_path):
    eqxckpt.save(tmp_path / "c", {"w": np.zeros(3, np.float32)})
    t = eqxckpt.CheckpointTranslator()
    t.add(r"w")(lambda opts, key, value: ("big", BIG[0]))
    view = t.apply(eqxckpt.open(tmp_path / "c"))
    sharded = jax.ShapeDtypeStruct((3,), np.int64, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    with pytest.raises(eqxckpt.CastError, match=r"big: int64 would become int32"):
        view.read([(view.leaf("big"), sharded)])
