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


def test_busy_is_not_a_kind_of_exists():
    """``except CheckpointExistsError: save(..., overwrite=True)`` (as documented) must not
    catch a place another process is saving to, and retry into it."""
    assert not issubclass(eqxckpt.CheckpointBusyError, eqxckpt.CheckpointExistsError)
    assert issubclass(eqxckpt.CheckpointBusyError, eqxckpt.CheckpointError)
    with pytest.raises(eqxckpt.CheckpointBusyError):
        try:
            raise eqxckpt.CheckpointBusyError("another save holds it")
        except eqxckpt.CheckpointExistsError:
            pytest.fail("a busy place was taken for an existing checkpoint")


def test_the_documented_retry_on_exists_never_saves_into_a_busy_place(s3):
    from conftest import s3_spec

    from eqxckpt._storage import resolve
    from eqxckpt._storage._lease import Lease, read_lease

    endpoint, _ = s3
    where = s3_spec(endpoint, "runs/busy-retry/")
    store = resolve(where).open_kvstore()
    # Another process, alive, is saving the first checkpoint there.
    lease = Lease(store, "save", read_lease(store)[0].stamp.generation, action="save", arrays=["%arrays." + "0" * 32])
    retried = []
    with pytest.raises(eqxckpt.CheckpointBusyError):
        try:
            eqxckpt.save(where, {"x": np.ones(3)})
        except eqxckpt.CheckpointExistsError:
            retried.append(True)
            eqxckpt.save(where, {"x": np.ones(3)}, overwrite=True)
    assert not retried
    lease.release()
    try:  # once the other save is done, the documented pattern saves
        eqxckpt.save(where, {"x": np.ones(3)})
    except eqxckpt.CheckpointExistsError:
        eqxckpt.save(where, {"x": np.ones(3)}, overwrite=True)
    np.testing.assert_array_equal(eqxckpt.load(where)["x"], np.ones(3))


def test_an_int_json_cannot_carry_is_refused_at_save_naming_the_leaf(tmp_path):
    """#53 item 5: a bare ValueError from deep in the manifest encoder; and an int of more
    digits than Python parses would have saved a checkpoint no load can read."""
    import sys

    limit = sys.get_int_max_str_digits()
    with pytest.raises(eqxckpt.UnsupportedLeafError, match=r"Leaf 'n': an int of about 5000 digits.*not loaded"):
        eqxckpt.save(tmp_path / "c", {"n": 10**5000})
    assert not (tmp_path / "c").exists()
    big = 10 ** (limit - 1)  # the most digits Python converts: saved and loaded exactly
    eqxckpt.save(tmp_path / "ok", {"n": big, "neg": -big})
    assert eqxckpt.load(tmp_path / "ok") == {"n": big, "neg": -big}
    # A process that raised its limit saved what no process with the default could load
    # (reported as a corrupt manifest): refused at save, whatever this process's limit.
    sys.set_int_max_str_digits(0)
    try:
        with pytest.raises(eqxckpt.UnsupportedLeafError, match=r"more than Python reads .* by default \(4300\)"):
            eqxckpt.save(tmp_path / "raised", {"n": 10**5000})
    finally:
        sys.set_int_max_str_digits(limit)
    # One written so anyway (by hand, or by an earlier eqxckpt): said so, not "corrupt".
    manifest = tmp_path / "ok" / "eqxckpt.json"
    manifest.write_bytes(manifest.read_bytes().replace(str(big).encode(), b"1" * 5000, 1))
    with pytest.raises(eqxckpt.ManifestError, match="set_int_max_str_digits"):
        eqxckpt.load(tmp_path / "ok")


def test_an_at_that_is_not_a_string_is_an_argument_error(tmp_path):
    eqxckpt.save(tmp_path / "c", {"n": 1})
    with pytest.raises(eqxckpt.ArgumentError, match="at must be a str or None, got int 5"):
        eqxckpt.load(tmp_path / "c", at=5)  # type: ignore[arg-type]


def test_every_warning_points_at_the_callers_line(tmp_path):
    """A warning names the line of the user's code that called eqxckpt, however deep in
    eqxckpt it is made (#55: a warning about a damaged file pointed inside the library):
    load(strict=False), load's cast, a save that finds its base damaged, a manager that
    skips entries that are not steps."""
    import warnings

    def warned(call) -> list[warnings.WarningMessage]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
        assert caught, "no warning"
        return caught

    eqxckpt.save(tmp_path / "c", {"w": np.arange(4.0, dtype=np.float32), "tiny": np.float64([1e-310, 1.0])})
    for caught in (
        warned(lambda: eqxckpt.load(tmp_path / "c", {"w": np.zeros(4, np.float32), "v": 1.0}, strict=False)),
        warned(
            lambda: eqxckpt.load(
                tmp_path / "c", {"w": np.zeros(4, np.float32), "tiny": np.zeros(2, np.float32)}, cast=True
            )
        ),
    ):
        assert [w.filename for w in caught] == [__file__] * len(caught), [(w.filename, w.lineno) for w in caught]
    # A base whose leaf is damaged: the save writes it again, and says so at the save's line.
    big = np.arange(1 << 16, dtype=np.float32)
    eqxckpt.save(tmp_path / "base", {"big": big})
    [chunk] = (tmp_path / "base" / "big" / "c").iterdir()
    raw = bytearray(chunk.read_bytes())
    raw[0] ^= 1
    chunk.write_bytes(bytes(raw))
    caught = warned(lambda: eqxckpt.save(tmp_path / "next", {"big": big}, base=tmp_path / "base"))
    assert [w.filename for w in caught] == [__file__] and "damaged there" in str(caught[0].message)
    # A manager that finds something other than steps in its run.
    (tmp_path / "run" / "notes").mkdir(parents=True)
    caught = warned(lambda: eqxckpt.CheckpointManager(tmp_path / "run").close())
    assert [w.filename for w in caught] == [__file__] and "not a step number" in str(caught[0].message)
