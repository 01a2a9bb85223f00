import numpy as np
import pytest

import eqxckpt


@pytest.fixture
def layered(tmp_path):
    tree = {"model": {"layers": [{"w": np.ones(2)}, {"w": np.zeros(2)}], "head": np.ones(1)}, "opt_state": 1}
    eqxckpt.save(tmp_path / "c", tree)
    return tmp_path / "c"


def test_an_at_typo_names_the_closest_full_path(layered):
    with pytest.raises(eqxckpt.CheckpointError) as info:
        eqxckpt.load(layered, at="model/layer/0")
    message = str(info.value)
    assert "Nothing under at='model/layer/0'" in message
    assert "Did you mean 'model/layers/0'" in message  # the closest first, as deep as `at`
    assert "Its top-level entries are: model, opt_state." in message
    # `open()[...]` and `leaf()` say it the same way.
    with pytest.raises(KeyError, match=r"Did you mean 'model/layers/0/w'"):
        eqxckpt.open(layered).leaf("model/layer/0/w")


@pytest.mark.parametrize("at", ["model.layers.0", "model.layers[0]", "model['layers'][0]"])
def test_an_at_with_dots_or_brackets_is_told_paths_use_slashes(layered, at):
    with pytest.raises(eqxckpt.CheckpointError) as info:
        eqxckpt.load(layered, at=at)
    assert f"Paths use '/' between keys (at='model/layers/0', not at={at!r})." in str(info.value)
    assert "Did you mean" not in str(info.value)  # the slashed path exists: no guessing


def test_a_dotted_typo_gets_both_hints(layered):
    with pytest.raises(eqxckpt.CheckpointError) as info:
        eqxckpt.load(layered, at="model.layer.0")
    message = str(info.value)
    assert "Did you mean 'model/layers/0'" in message and "Paths use '/' between keys" in message


def test_the_cli_gives_the_same_hints(layered, capsys):
    from eqxckpt._cli import main

    assert main(["inspect", str(layered), "--at", "model.layers.1"]) == 1
    assert "at='model/layers/1'" in capsys.readouterr().err


@pytest.mark.parametrize("at", ["model/./w", "model/../opt"])
def test_the_slash_hint_for_a_wrong_at_names_a_path_that_exists(tmp_path, at):
    # The "Paths use '/'" hint (new since b0b80a8) rewrote these into at='model///w' and
    # at='model////opt': a path no checkpoint has, offered as the fix.
    import re

    tree = {"model": {"w": np.ones(3, np.float32)}, "opt": {"mu": np.ones(3, np.float32)}}
    eqxckpt.save(tmp_path / "c", tree)
    with pytest.raises(eqxckpt.CheckpointError) as caught:
        eqxckpt.load(tmp_path / "c", like=None, at=at)
    for suggested in re.findall(r"\(at='([^']*)', not", str(caught.value)):
        eqxckpt.load(tmp_path / "c", like=None, at=suggested)  # the fix offered must work


def test_a_leaf_read_twice_gives_values_that_share_no_buffer(tmp_path):
    # A jax array adopts its host buffer: a numpy value of the same buffer would change it.
    import jax.numpy as jnp

    tree = {"w": jnp.arange(1024.0, dtype=jnp.float32), **{f"s{i}": jnp.arange(16.0) + i for i in range(40)}}
    eqxckpt.save(tmp_path / "c", tree)
    ckpt = eqxckpt.open(tmp_path / "c")
    leaf = ckpt.leaf("w")
    assert isinstance(leaf, eqxckpt.StoredLeaf)
    adopted, host = ckpt.read([(leaf, None), (leaf, np.zeros(leaf.shape, np.float32))])
    host[0] = 99.0
    assert float(adopted[0]) == 0.0
    np.testing.assert_array_equal(np.asarray(adopted), np.arange(1024.0, dtype=np.float32))


def test_a_read_into_jax_refuses_64_bit_data_it_would_narrow(tmp_path):
    # With x64 off JAX turns int64 into int32: 2**40 + [0, 1, 2] read as [0, 1, 2], silently.
    import jax

    big = 2**40 + np.arange(3)
    with jax.enable_x64(True):
        eqxckpt.save(tmp_path / "c", {"j": jax.numpy.asarray(big), "n": big, "f": jax.numpy.ones(2, "float32")})
    assert not jax.config.read("jax_enable_x64")
    ckpt = eqxckpt.open(tmp_path / "c")
    j, n, f = (ckpt.leaf(p) for p in "jnf")
    assert isinstance(j, eqxckpt.StoredLeaf) and isinstance(n, eqxckpt.StoredLeaf) and isinstance(f, eqxckpt.StoredLeaf)
    with pytest.raises(eqxckpt.CastError, match=r"1 leaves would change: j: int64 would become int32") as caught:
        ckpt.read([(f, None), (j, None)])
    assert "jax_enable_x64" in str(caught.value)
    with pytest.raises(eqxckpt.CastError, match=r"j: int64"):
        ckpt.read([(j, jax.ShapeDtypeStruct((3,), np.int64))])
    # Into numpy, as saved into numpy, or cast into a 32-bit target: nothing changes silently.
    np.testing.assert_array_equal(ckpt.read([(j, np.zeros(3, np.int64))])[0], big)
    np.testing.assert_array_equal(ckpt.read([(n, None)])[0], big)
    np.testing.assert_array_equal(ckpt["j"].get(), big)
    with jax.enable_x64(True):
        np.testing.assert_array_equal(np.asarray(ckpt.read([(j, None)])[0]), big)


def test_a_read_of_a_leaf_with_no_stored_array_says_so(tmp_path):
    eqxckpt.save(tmp_path / "c", {"a": np.ones(2), "s": 3})
    ckpt = eqxckpt.open(tmp_path / "c")
    with pytest.raises(eqxckpt.ArgumentError, match=r"\['s'\] of .* hold none") as caught:
        ckpt.read([(ckpt.leaf("a"), None), (ckpt.leaf("s"), None)])
    assert "leaf(path).value()" in str(caught.value)
    assert ckpt.leaf("s").value() == 3
    with pytest.raises(eqxckpt.ArgumentError, match=r"Leaf 'a' \(float64\[2\]\) is a stored array.*\.get\(\)"):
        ckpt.leaf("a").value()


def test_a_narrowing_mismatch_says_what_was_found_and_why(tmp_path):
    # Not "expected int64[3], found int64[3]": the like matches; JAX is what would change it.
    import jax

    with jax.enable_x64(True):
        eqxckpt.save(tmp_path / "c", {"j": jax.numpy.asarray(2**40 + np.arange(3))})
    with pytest.raises(eqxckpt.StructureMismatchError) as caught:
        eqxckpt.load(tmp_path / "c", {"j": jax.ShapeDtypeStruct((3,), np.int64)})
    message = str(caught.value)
    assert "found int64[3], which cannot be restored as it is: int64 would become int32" in message
    assert "expected int64[3]" not in message


class Rows(eqxckpt.Source):
    """#52's toy format, as a new format's author writes one (`Source`'s contract): numpy
    arrays in memory, read whole or by boxes of whole rows; every read is logged."""

    def __init__(self, arrays):
        self.location, self.metadata, self.arrays, self.log = "memory", {"step": 7}, arrays, []
        self._leaves = {}
        for path, array in arrays.items():
            keys = tuple(("dict", part) for part in path.split("/"))
            self._leaves[path] = eqxckpt.ArrayLeaf(path, keys, array.shape, array.dtype.name)

    def _fetch(self, leaves, done, reserve):
        reserve(sum(leaf.nbytes for leaf in leaves))
        for i, leaf in enumerate(leaves):
            self.log.append(("whole", leaf.path))
            done(i, self.arrays[leaf.path].copy())

    def chunk_shapes(self, leaves):
        return [(1, *leaf.shape[1:]) if leaf.shape else None for leaf in leaves]

    def _read_boxes(self, leaf, boxes, window):
        for box, out in boxes:
            assert all(r.step > 0 for r in box) and out.flags.c_contiguous
            self.log.append(("box", leaf.path, tuple((r.start, r.stop, r.step) for r in box)))
            out[...] = self.arrays[leaf.path][tuple(slice(r.start, r.stop, r.step) for r in box)]


def test_a_new_format_is_a_fetch_and_a_box_reader(tmp_path, monkeypatch):
    """#52: a format that implements `_fetch`, `chunk_shapes` and `_read_boxes` alone
    restores, slices lazily, restacks (both ways), is placed band by band, is copied part by
    part into a save and is translated: the engine does the rest, reading only what it needs."""
    import jax
    import jax.numpy as jnp

    from eqxckpt._read import _place

    rng = np.random.default_rng(0)
    arrays = {
        "w": rng.standard_normal((6, 4)).astype(np.float32),
        "layers/0/b": np.arange(3, dtype=np.float32),
        "layers/1/b": np.arange(3, 6, dtype=np.float32),
        "stacked": rng.standard_normal((4, 5)).astype(np.float32),
    }
    rows = Rows({"w": arrays["w"]})
    # A plain restore: whole, through the format's one fetch.
    out = eqxckpt.load(rows, {"w": jnp.zeros((6, 4))})
    np.testing.assert_array_equal(np.asarray(out["w"]), arrays["w"])
    assert isinstance(out["w"], jax.Array) and rows.log == [("whole", "w")]
    # A lazy slice reads its rows only, strided as asked; a scalar read whole.
    rows.log.clear()
    np.testing.assert_array_equal(rows["w"][1:5:2, ::3].get(), arrays["w"][1:5:2, ::3])
    assert rows.log == [("box", "w", ((1, 5, 2), (0, 4, 3)))]
    assert rows.metadata == {"step": 7} and rows.leaf("w").describe() == "float32[6,4]"
    # Stack: layers into a scanned leaf; Unstack: rows of a stacked leaf, each read once.
    layered = Rows({k: v for k, v in arrays.items() if k != "w"})
    like = {"b": jax.ShapeDtypeStruct((2, 3), jnp.float32), "rows": [np.zeros(5, np.float32) for _ in range(4)]}
    transforms = {"b": eqxckpt.Stack("layers/{i}/b"), r"rows/(\d+)": eqxckpt.Unstack("stacked", index=r"\1")}
    out = eqxckpt.load(layered, like, transforms=transforms)
    np.testing.assert_array_equal(np.asarray(out["b"]), np.stack([arrays["layers/0/b"], arrays["layers/1/b"]]))
    for i in range(4):
        np.testing.assert_array_equal(out["rows"][i], arrays["stacked"][i])
    read_rows = [r for kind, path, *box in layered.log if path == "stacked" for r in range(*box[0][0][:2])]
    assert sorted(read_rows) == [0, 1, 2, 3]  # every row of the stacked leaf once
    # Larger than the host memory budget, cast on the way to a device: placed a band at a time.
    rows.log.clear()
    monkeypatch.setattr(_place, "STAGE_CPU", True)  # a GPU's path, on this machine's CPU
    placed = eqxckpt.load(rows, {"w": jnp.zeros((6, 4), jnp.bfloat16)}, cast=True, host_memory_budget=64)
    np.testing.assert_array_equal(np.asarray(placed["w"]), arrays["w"].astype(jnp.bfloat16))
    assert len(rows.log) > 1 and all(kind == "box" for kind, *_ in rows.log)
    monkeypatch.setattr(_place, "STAGE_CPU", False)
    # A region into a caller's buffer; a save copying a lazy selection part by part.
    region = np.empty((2, 4), np.float32)
    rows.read_into(rows.leaf("w"), (slice(2, 4), slice(0, 4)), region)
    np.testing.assert_array_equal(region, arrays["w"][2:4])
    eqxckpt.save(tmp_path / "copy", {"w": rows["w"][::2]})
    np.testing.assert_array_equal(eqxckpt.load(tmp_path / "copy")["w"], arrays["w"][::2])
    # A translated view reads through the format as it is.
    translator = eqxckpt.CheckpointTranslator()
    translator.add(r"w")(lambda opts, key, value: ("kernel", value))
    view = translator.apply(rows)
    np.testing.assert_array_equal(view["kernel"][3].get(), arrays["w"][3])


def test_a_format_listing_a_leaf_and_a_subtree_of_one_name_is_refused():
    """A format's listing is its author's: one that names ``a`` both a leaf and a subtree
    has no one tree. The tree builder refuses it, naming it (it raised a bare TypeError
    or AttributeError, after reading)."""
    rows = Rows({"a": np.ones(2, np.float32), "a/b": np.zeros(2, np.float32)})
    for build in (lambda: eqxckpt.load(rows), rows.tree):
        with pytest.raises(eqxckpt.ManifestError, match="'a' is both a leaf and a subtree"):
            build()
    np.testing.assert_array_equal(rows["a/b"].get(), np.zeros(2, np.float32))  # each leaf still reads by path


def test_a_formats_own_failure_in_a_restore_names_the_leaves_it_was_reading():
    """A format may raise its own errors from `_fetch`; a lazy read named the leaf, but a
    restore let the bare OSError out (the third outside attack of #52)."""
    import jax.numpy as jnp

    class Failing(Rows):
        def _fetch(self, leaves, done, reserve):
            raise OSError("disk on fire")

    failing = Failing({"w": np.ones((3, 2), np.float32)})
    with pytest.raises(eqxckpt.CorruptCheckpointError, match=r"\['w'\].*OSError: disk on fire") as caught:
        eqxckpt.load(failing, {"w": jnp.zeros((3, 2))})
    assert caught.value.leaf_path == "w"
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="'w'"):
        failing["w"].get()
