import pickle

import numpy as np
import pytest

import eqxckpt


def test_structure_mismatch_lists_every_difference_as_fields(tmp_path):
    eqxckpt.save(tmp_path / "c", {"a": np.zeros(3, np.float32), "b": np.zeros(2, np.float32), "x": 1})
    like = {"a": np.zeros(4, np.float32), "c": np.zeros(1, np.float32), "x": 1}
    with pytest.raises(eqxckpt.StructureMismatchError) as info:
        eqxckpt.load(tmp_path / "c", like)
    error = info.value
    assert error.missing == [("c", "expected float32[1]")]
    assert error.unexpected == [("b", "found float32[2]")]
    assert [path for path, _ in error.mismatched] == [
        "a"
    ] and "expected float32[4], found float32[3]" in error.mismatched[0][1]
    assert "missing from the checkpoint (1)" in str(error)


@pytest.mark.parametrize(
    "error",
    [
        eqxckpt.StructureMismatchError("m", missing=[("a", "x")], unexpected=[("b", "y")], mismatched=[("c", "z")]),
        eqxckpt.CorruptCheckpointError("damaged", leaf_path="model/w"),
        eqxckpt.TransformError("bad rule"),
        eqxckpt.CheckpointWriteError(28, "No space left on device"),
        eqxckpt.CastError("would change"),
    ],
)
def test_errors_cross_processes_with_their_fields(error):
    """Errors pickle with their fields, so a worker's error reaches its parent whole."""
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error) and vars(back) == vars(error)
    assert isinstance(back, eqxckpt.CheckpointError)


def test_a_corrupt_leaf_error_names_its_path(tmp_path):
    eqxckpt.save(tmp_path / "c", {"w": np.arange(1000.0)})
    chunk = next((tmp_path / "c/w/c").rglob("*"))
    chunk.write_bytes(b"\0" * chunk.stat().st_size)
    with pytest.raises(eqxckpt.CorruptCheckpointError) as info:
        eqxckpt.load(tmp_path / "c")
    assert info.value.leaf_path == "w"
    assert not hasattr(info.value, "path")  # a leaf's path is never called a location
