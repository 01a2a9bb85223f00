"""TensorFlow checkpoints, written by TensorFlow, read through the same open and load."""

import ml_dtypes
import numpy as np
import pytest
from conftest import save_tf_tensors

import eqxckpt

tf = pytest.importorskip("tensorflow")


@pytest.fixture(scope="module")
def tf_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tf") / "ckpt"
    tensors = {
        "encoder/block_000/kernel": np.arange(12, dtype=np.float32).reshape(3, 4),
        "encoder/block_000/scale": np.linspace(0, 1, 4).astype(ml_dtypes.bfloat16),
        "global_step": np.int64(7),
    }
    save_tf_tensors(directory, tensors)
    return directory, tensors


def test_a_tf_checkpoint_opens_and_loads_like_any_other(tf_checkpoint):
    directory, tensors = tf_checkpoint
    for where in (directory, directory / "model.ckpt-7"):  # a directory, or a prefix
        ckpt = eqxckpt.open(where)
        assert sorted(ckpt.paths) == sorted(tensors)
        assert ckpt.leaf("encoder/block_000/scale").describe() == "bfloat16[4]"
    encoder = eqxckpt.load(directory, at="encoder/block_000")
    for name in ("kernel", "scale"):
        value = tensors[f"encoder/block_000/{name}"]
        assert encoder[name].dtype == value.dtype and encoder[name].tobytes() == value.tobytes()
    like = {"kernel": np.zeros((3, 4), np.float32), "scale": np.zeros(4, np.float32)}
    cast = eqxckpt.load(directory, like, at="encoder/block_000", cast=True)
    np.testing.assert_array_equal(cast["scale"], tensors["encoder/block_000/scale"].astype(np.float32))
    translator = eqxckpt.CheckpointTranslator()

    @translator.add(r"encoder/block_(\d+)/(\w+)")
    def _(opts, key, value, block, name):
        return f"blocks/{int(block)}/{name}", value

    @translator.add(r"global_step")
    def _(opts, key, value):
        return "step", value

    view = translator.apply(eqxckpt.open(directory, format="tf"))
    assert int(eqxckpt.load(view, at="step")) == 7
    np.testing.assert_array_equal(eqxckpt.load(view, at="blocks/0/kernel"), tensors["encoder/block_000/kernel"])
