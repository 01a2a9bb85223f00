"""TensorFlow checkpoints, written by TensorFlow, read through the same open and load."""

import os

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


@pytest.mark.tf
def test_a_restore_larger_than_the_memory_left_is_refused_before_tensorflow_reads(tf_checkpoint, monkeypatch):
    """As for every other source: the index's shapes are checked against the memory the
    kernel says is left before TensorFlow allocates anything; what fits still loads."""
    import eqxckpt._window

    directory, tensors = tf_checkpoint
    nbytes = sum(value.nbytes for value in tensors.values())
    monkeypatch.setattr(eqxckpt._window, "available_memory", lambda: nbytes - 1)
    with pytest.raises(eqxckpt.CheckpointError, match=f"Restoring {len(tensors)} leaves from .* needs .* host memory"):
        eqxckpt.load(directory)
    scale = eqxckpt.load(directory, at="encoder/block_000/scale")  # 8 bytes: fits
    assert scale.tobytes() == tensors["encoder/block_000/scale"].tobytes()


@pytest.mark.tf
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


@pytest.mark.tf
def test_names_that_are_a_leaf_and_a_subtree_are_refused(tmp_path):
    save_tf_tensors(tmp_path / "ckpt", {"a": np.ones(2, np.float32), "a/b": np.zeros(2, np.float32)})
    with pytest.raises(eqxckpt.ManifestError, match="'a' is a tensor and also holds 'a/b'"):
        eqxckpt.open(tmp_path / "ckpt")


@pytest.mark.tf
@pytest.mark.parametrize("named", ["absolute", "../other/model.ckpt-7", "sub/../../other/model.ckpt-7"])
def test_the_checkpoint_file_cannot_lead_out_of_the_directory(tmp_path, named):
    save_tf_tensors(tmp_path / "other", {"secret": np.full(3, 42.0, np.float32)})
    save_tf_tensors(tmp_path / "ckpt", {"mine": np.ones(2, np.float32)})
    target = str(tmp_path / "other" / "model.ckpt-7") if named == "absolute" else named
    (tmp_path / "ckpt" / "checkpoint").write_text(f'model_checkpoint_path: "{target}"\n')
    with pytest.raises(eqxckpt.ManifestError, match="outside") as e:
        eqxckpt.load(tmp_path / "ckpt")
    assert "this directory holds" in str(e.value)  # and says how to read its own one
    assert eqxckpt.load(tmp_path / "ckpt" / "model.ckpt-7")["mine"].tolist() == [1.0, 1.0]


@pytest.mark.tf
def test_a_fifo_or_symlink_among_the_files_is_refused_without_hanging(tmp_path):
    from conftest import release_fifo, returns_within

    save_tf_tensors(tmp_path / "ckpt", {"w": np.ones(2, np.float32)})
    [data] = (tmp_path / "ckpt").glob("model.ckpt-7.data-*")
    data.unlink()
    os.mkfifo(data)
    with pytest.raises(eqxckpt.ManifestError, match="symlink or special file"):
        returns_within(lambda: eqxckpt.load(tmp_path / "ckpt"), release=lambda: release_fifo(data))
    data.unlink()
    data.symlink_to(tmp_path / "anywhere")
    with pytest.raises(eqxckpt.ManifestError, match="symlink or special file"):
        eqxckpt.open(tmp_path / "ckpt" / "model.ckpt-7")


@pytest.mark.tf
def test_truncated_or_flipped_data_is_a_corrupt_checkpoint_error_naming_the_leaf(tmp_path):
    tensors = {"w": np.arange(4096, dtype=np.float32), "v": np.ones(8, np.float32)}
    for damage in ("truncate", "flip"):
        directory = tmp_path / damage
        save_tf_tensors(directory, tensors)
        [data] = directory.glob("model.ckpt-7.data-*")
        raw = bytearray(data.read_bytes())
        if damage == "truncate":
            del raw[len(raw) // 2 :]
        else:
            raw[len(raw) - 100] ^= 0x10  # inside 'w' (names are sorted: 'v', then 'w')
        data.write_bytes(bytes(raw))
        with pytest.raises(eqxckpt.CorruptCheckpointError, match="Leaf 'w': TensorFlow could not read variable 'w'"):
            eqxckpt.load(directory)


def test_a_tf2_object_graph_is_skipped(tmp_path):
    variable = tf.Variable(np.arange(3, dtype=np.float32))
    prefix = tf.train.Checkpoint(weights=variable).write(str(tmp_path / "tf2" / "ckpt"))
    ckpt = eqxckpt.open(prefix)
    assert "_CHECKPOINTABLE_OBJECT_GRAPH" not in ckpt.paths
    assert eqxckpt.load(prefix)["weights"][".ATTRIBUTES"]["VARIABLE_VALUE"].tolist() == [0.0, 1.0, 2.0]
    from eqxckpt._cli import main

    assert main(["convert", prefix, str(tmp_path / "out")]) == 0
    assert eqxckpt.open(tmp_path / "out").paths == ["weights/.ATTRIBUTES/VARIABLE_VALUE"]


@pytest.mark.tf
def test_a_checkpoint_file_that_is_a_fifo_is_refused_without_hanging(tmp_path):
    from conftest import release_fifo, returns_within

    save_tf_tensors(tmp_path / "ckpt", {"w": np.ones(2, np.float32)})
    (tmp_path / "ckpt" / "checkpoint").unlink()
    os.mkfifo(tmp_path / "ckpt" / "checkpoint")
    with pytest.raises(eqxckpt.ManifestError, match="symlink or special file"):
        returns_within(
            lambda: eqxckpt.open(tmp_path / "ckpt", format="tf"),
            release=lambda: release_fifo(tmp_path / "ckpt" / "checkpoint"),
        )


@pytest.mark.tf
def test_a_directory_given_by_a_relative_path_reads_its_own_checkpoint(tmp_path, monkeypatch):
    save_tf_tensors(tmp_path / "ckpt", {"w": np.ones(2, np.float32)})
    monkeypatch.chdir(tmp_path)
    assert eqxckpt.load("ckpt")["w"].tolist() == [1.0, 1.0]
    (tmp_path / "ckpt" / "checkpoint").write_text('model_checkpoint_path: "../ckpt/model.ckpt-7"\n')
    assert eqxckpt.load("ckpt")["w"].tolist() == [1.0, 1.0]  # leaves and comes back: still inside


@pytest.mark.tf
def test_tf_variables_are_lazy_arrays_that_slice_and_cast(tf_checkpoint):
    directory, tensors = tf_checkpoint
    ckpt = eqxckpt.open(directory)
    kernel = ckpt["encoder/block_000/kernel"]
    assert isinstance(kernel, eqxckpt.LazyArray)
    expected = tensors["encoder/block_000/kernel"]
    np.testing.assert_array_equal(kernel[1:, ::-2].get(), expected[1:, ::-2])
    np.testing.assert_array_equal(kernel[2].astype(np.float16).get(), expected[2].astype(np.float16))
    scale = ckpt["encoder/block_000/scale"][:2].astype(np.float32)
    assert scale.dtype == np.float32 and scale.shape == (2,)
    np.testing.assert_array_equal(scale.get(), tensors["encoder/block_000/scale"][:2].astype(np.float32))
