import json
import pathlib
import shutil
import subprocess
import sys
import textwrap
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_equal, crafted_manifest, manifest_doc, pyright_path

import eqxckpt


def make_model(depth=2, key=None):
    return eqx.nn.MLP(4, 3, 16, depth, key=jax.random.key(0) if key is None else key)


@pytest.fixture
def state_ckpt(tmp_path):
    model = make_model()
    opt_state = optax.adam(1e-3).init(eqx.filter(model, eqx.is_array))
    tree = {"model": model, "opt_state": opt_state, "step": 5}
    eqxckpt.save(tmp_path / "c", tree, metadata={"step": 5})
    return tmp_path / "c", tree


def test_like_forms_give_identical_results(state_ckpt):
    path, tree = state_ckpt
    model = tree["model"]
    from_arrays = eqxckpt.load(path, make_model(key=jax.random.key(9)), at="model")
    from_skeleton = eqxckpt.load(path, eqx.filter_eval_shape(make_model), at="model")
    from_callable = eqxckpt.load(path, make_model, at="model")
    for restored in (from_arrays, from_skeleton, from_callable):
        assert_trees_equal(restored, model)
        assert restored(jnp.ones(4)).shape == (3,)


def test_like_none_rebuilds_plain_containers(state_ckpt):
    path, tree = state_ckpt
    plain = eqxckpt.load(path)
    np.testing.assert_array_equal(plain["model"]["layers"][1]["weight"], tree["model"].layers[1].weight)
    assert plain["step"] == 5
    assert plain["model"]["activation"] is None  # functions are not stored
    assert isinstance(plain["opt_state"], list) and "mu" in plain["opt_state"][0]
    sub = eqxckpt.load(path, at="model/layers/0")
    assert set(sub) == {"weight", "bias"}


def test_at_reads_only_the_selected_bytes(state_ckpt):
    path, tree = state_ckpt
    shutil.rmtree(path / "opt_state")  # if load touched it, it would fail
    assert_trees_equal(eqxckpt.load(path, make_model, at="model"), tree["model"])
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="opt_state/0/count"):
        eqxckpt.load(path)


def test_strict_reports_every_difference(state_ckpt):
    path, _ = state_ckpt
    bigger = lambda: eqx.nn.MLP(4, 3, 32, 3, key=jax.random.key(0))  # noqa: E731
    with pytest.raises(eqxckpt.StructureMismatchError) as info:
        eqxckpt.load(path, bigger, at="model")
    msg = str(info.value)
    assert "missing from the checkpoint (2)" in msg and "layers/3/weight: expected float32[3,32]" in msg
    assert "layers/0/weight: expected float32[32,4], found float32[16,4]" in msg
    with pytest.raises(eqxckpt.StructureMismatchError, match=r"in the checkpoint but not in `like` \(2\)"):
        eqxckpt.load(path, lambda: eqx.nn.MLP(4, 3, 16, 1, key=jax.random.key(0)), at="model")
    # the whole state into just a model: opt_state and step are unexpected
    with pytest.raises(eqxckpt.StructureMismatchError, match="opt_state/0/mu/layers/0/weight"):
        eqxckpt.load(path, {"model": make_model()})


def test_dtype_change_only_when_asked(state_ckpt):
    path, tree = state_ckpt

    def bf16():
        return eqx.filter_eval_shape(
            lambda: jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16) if eqx.is_array(x) else x, make_model())
        )  # noqa: E731

    with pytest.raises(eqxckpt.StructureMismatchError, match="cast=True"):
        eqxckpt.load(path, bf16(), at="model")
    cast = eqxckpt.load(path, bf16(), at="model", cast=True)
    assert cast.layers[0].weight.dtype == jnp.bfloat16
    np.testing.assert_array_equal(cast.layers[0].weight, tree["model"].layers[0].weight.astype(jnp.bfloat16))


def test_non_strict_fills_from_concrete_like_and_warns(state_ckpt):
    path, tree = state_ckpt
    like = {"model": make_model(key=jax.random.key(3)), "extra": jnp.full(2, 7.0)}
    with pytest.warns(UserWarning, match=r"kept `like`'s values for 1 leaves missing.*extra.*ignored 14"):
        out = eqxckpt.load(path, like, strict=False)
    assert_trees_equal(out["model"], tree["model"])
    np.testing.assert_array_equal(out["extra"], jnp.full(2, 7.0))
    # a skeleton cannot supply a value: still an error
    with pytest.raises(eqxckpt.StructureMismatchError, match="extra"):
        eqxckpt.load(path, eqx.filter_eval_shape(lambda: like), strict=False)


def test_numpy_like_gives_numpy(tmp_path):
    tree = {"a": np.arange(6.0).reshape(2, 3), "b": jnp.arange(3), "c": np.float64(2.5)}
    eqxckpt.save(tmp_path / "c", tree)
    out = eqxckpt.load(tmp_path / "c", tree)
    assert type(out["a"]) is np.ndarray and isinstance(out["b"], jax.Array) and type(out["c"]) is np.float64
    assert_trees_equal(out, tree)


def test_single_leaf_at(state_ckpt):
    path, tree = state_ckpt
    w = eqxckpt.load(path, jax.ShapeDtypeStruct((16, 4), jnp.float32), at="model/layers/0/weight")
    np.testing.assert_array_equal(w, tree["model"].layers[0].weight)


def test_at_nothing_lists_top_level(state_ckpt):
    path, _ = state_ckpt
    with pytest.raises(eqxckpt.CheckpointError, match="model, opt_state, step"):
        eqxckpt.load(path, make_model, at="params")


def test_sharded_skeleton_is_honoured(state_ckpt):
    path, tree = state_ckpt
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    skeleton = jax.tree_util.tree_map(
        lambda s: (
            jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding) if isinstance(s, jax.ShapeDtypeStruct) else s
        ),
        eqx.filter_eval_shape(make_model),
    )
    out = eqxckpt.load(path, skeleton, at="model")
    assert out.layers[0].weight.sharding == sharding
    assert_trees_equal(out, tree["model"])


def test_uncommitted_directory_is_refused(tmp_path):
    eqxckpt.save(tmp_path / "c", {"a": np.ones(3)})
    (tmp_path / "c" / "eqxckpt.json").unlink()
    with pytest.raises(eqxckpt.IncompleteCheckpointError, match="never committed"):
        eqxckpt.load(tmp_path / "c")
    with pytest.raises(eqxckpt.IncompleteCheckpointError):
        eqxckpt.open(tmp_path / "c")


def test_interrupted_save_is_reported(tmp_path):
    (tmp_path / ".c.eqxckpt-tmp-123456").mkdir()
    with pytest.raises(eqxckpt.IncompleteCheckpointError, match="interrupted"):
        eqxckpt.load(tmp_path / "c")


def test_missing_path(tmp_path):
    with pytest.raises(eqxckpt.CheckpointNotFoundError, match="does not exist"):
        eqxckpt.load(tmp_path / "nope")


def test_unknown_version_is_refused(state_ckpt):
    path, _ = state_ckpt
    doc = manifest_doc((path / "eqxckpt.json").read_text())
    doc["version"] = 6
    (path / "eqxckpt.json").write_bytes(crafted_manifest(doc))
    with pytest.raises(eqxckpt.ManifestError, match="version 6.*Upgrade eqxckpt"):
        eqxckpt.load(path)


def test_corrupt_chunk_names_the_leaf(state_ckpt):
    path, _ = state_ckpt
    chunk = path / "model/layers/1/weight/c/0/0"
    data = bytearray(chunk.read_bytes())
    data[3] ^= 0x10
    chunk.write_bytes(bytes(data))
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="model/layers/1/weight"):
        eqxckpt.load(path, make_model, at="model")


def test_prng_keys_restore_into_skeletons(tmp_path):
    tree = {"k": jax.random.key(7), "ks": jax.random.split(jax.random.key(1, impl="rbg"), 4)}
    eqxckpt.save(tmp_path / "c", tree)
    out = eqxckpt.load(tmp_path / "c", eqx.filter_eval_shape(lambda: tree))
    assert_trees_equal(out, tree)
    assert jax.random.uniform(out["k"]) == jax.random.uniform(tree["k"])
    with pytest.raises(eqxckpt.StructureMismatchError, match="key"):
        eqxckpt.load(tmp_path / "c", {"k": jax.random.key(0), "ks": jax.random.split(jax.random.key(0), 4)})


def test_64_bit_data_never_narrows_silently(tmp_path):
    """Saved with jax_enable_x64, loaded without: an error that says what to do, not
    int32 [0, -1] for int64 [-2**63, 2**63-1]."""
    with jax.enable_x64(True):
        tree = {
            "i": jnp.array([-(2**63), 2**63 - 1], jnp.int64),
            "u": jnp.array([2**64 - 1], jnp.uint64),
            "f": jnp.array([1e-310, 1.0], jnp.float64),
            "c": jnp.array([1 + 1e-300j], jnp.complex128),
            "small": jnp.array([1, -7], jnp.int64),
        }
        eqxckpt.save(tmp_path / "c", tree)
        exact = eqxckpt.load(tmp_path / "c")
        assert exact["i"].dtype == jnp.int64 and int(exact["i"][0]) == -(2**63)
    assert not jax.config.read("jax_enable_x64")
    with pytest.raises(eqxckpt.CastError, match="jax_enable_x64") as caught:
        eqxckpt.load(tmp_path / "c")
    assert all(f"{leaf}:" in str(caught.value) for leaf in ("i", "u", "f", "c", "small"))
    skeleton = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in tree.items()}  # 64-bit skeletons
    with pytest.raises(eqxckpt.StructureMismatchError, match="jax_enable_x64"):
        eqxckpt.load(tmp_path / "c", skeleton)
    # numpy leaves hold 64 bits with or without x64
    as_numpy = eqxckpt.load(tmp_path / "c", {k: np.zeros(v.shape, v.dtype) for k, v in tree.items()})
    assert as_numpy["i"].tolist() == [-(2**63), 2**63 - 1] and as_numpy["f"][0] == 1e-310
    # an explicit cast checks that the values fit
    narrow = {"small": jnp.zeros(2, jnp.int32)}
    assert eqxckpt.load(tmp_path / "c", narrow, cast=True, strict=False)["small"].tolist() == [1, -7]
    with pytest.raises(eqxckpt.CastError, match="outside"):
        eqxckpt.load(tmp_path / "c", {"i": jnp.zeros(2, jnp.int32)}, cast=True, strict=False)
    with pytest.raises(eqxckpt.CastError, match="outside"):
        eqxckpt.load(tmp_path / "c", {"u": jnp.zeros(1, jnp.uint32)}, cast=True, strict=False)
    with pytest.warns(UserWarning, match="flushed tiny nonzero values to zero"):
        flushed = eqxckpt.load(tmp_path / "c", {"f": jnp.zeros(2, jnp.float32)}, cast=True, strict=False)
    assert flushed["f"].tolist() == [0.0, 1.0]
    eqxckpt.save(tmp_path / "big", {"f": np.array([1e300])})
    with pytest.raises(eqxckpt.CastError, match="infinities"):
        eqxckpt.load(tmp_path / "big", {"f": np.zeros(1, np.float32)}, cast=True)


def test_a_run_directory_is_named_and_its_checkpoints_listed(tmp_path):
    eqxckpt.save(tmp_path / "ckpt" / "step_10", {"x": np.zeros(2)})
    with pytest.raises(
        eqxckpt.CheckpointNotFoundError, match=r"not a checkpoint but a directory of 1 checkpoint: step_10\."
    ):
        eqxckpt.load(tmp_path / "ckpt")
    with eqxckpt.CheckpointManager(tmp_path / "run") as manager:
        for step in (0, 5, 10):
            manager.save(step, {"x": np.zeros(2)})
    with pytest.raises(eqxckpt.CheckpointNotFoundError) as info:
        eqxckpt.load(tmp_path / "run", {"x": np.zeros(2)})
    message = str(info.value)
    assert "directory of 3 checkpoints (a CheckpointManager run): 0, 5, 10" in message
    assert "CheckpointManager(...).load(like)" in message and "never committed" not in message


def test_a_missing_at_is_suggested_when_a_prefix_fits(tmp_path):
    eqxckpt.save(tmp_path / "c", {"model": {"w": np.zeros(2), "b": np.ones(3)}, "opt_state": {"m": np.zeros(2)}})
    like = {"w": jax.ShapeDtypeStruct((2,), jnp.float64), "b": jax.ShapeDtypeStruct((3,), jnp.float64)}
    with pytest.raises(eqxckpt.StructureMismatchError) as info:
        eqxckpt.load(tmp_path / "c", like)
    assert "Every missing leaf is in the checkpoint under 'model': pass at='model'." in str(info.value)
    assert "strict=False keeps" in str(info.value)
    with pytest.raises(eqxckpt.StructureMismatchError) as info:
        eqxckpt.load(tmp_path / "c", like, strict=False)
    assert "pass at='model'" in str(info.value) and "strict=False" not in str(info.value)  # already passed
    with pytest.warns(UserWarning, match="under 'model': pass at='model'"):
        eqxckpt.load(tmp_path / "c", {"w": np.zeros(2), "b": np.ones(3)}, strict=False)
    with pytest.raises(eqxckpt.StructureMismatchError) as info:
        eqxckpt.load(tmp_path / "c", {"w": np.zeros(2), "q": np.ones(3)})
    assert "pass at=" not in str(info.value)  # no prefix holds both


def test_a_sequence_with_holes_is_a_damaged_manifest_not_nones(tmp_path):
    eqxckpt.save(tmp_path / "c", {"seq": [np.array(1), np.array(2)]})
    doc = manifest_doc((tmp_path / "c" / "eqxckpt.json").read_text())
    doc.pop("sequences_complete")  # as manifests written before it was recorded, which may have gaps
    second = doc["leaves"][1]
    second["path"] = second["location"] = "seq/5"
    second["keys"][1][1] = 5
    (tmp_path / "c" / "seq" / "1").rename(tmp_path / "c" / "seq" / "5")
    (tmp_path / "c" / "eqxckpt.json").write_bytes(crafted_manifest(doc))
    for read in (lambda: eqxckpt.load(tmp_path / "c"), lambda: eqxckpt.open(tmp_path / "c").tree()):
        with pytest.raises(eqxckpt.ManifestError, match=r"sequence at 'seq' has items \[0, 5\].*not exactly 0\.\.1"):
            read()


def test_a_stored_flag_that_differs_from_likes_wins_and_says_so(tmp_path):
    """As in Equinox's own deserialisation, stored values win; a flag (Dropout's `inference`)
    is what users expect `like` to decide, so a difference is a warning that says how to choose."""
    net = eqx.nn.Sequential([eqx.nn.Linear(2, 2, key=jax.random.key(0)), eqx.nn.Dropout(0.5)])
    eqxckpt.save(tmp_path / "c", net)  # training mode
    with pytest.warns(UserWarning, match=r"where they differ \(1 flag: .*layers/1/inference: False \(like: True\)"):
        loaded = eqxckpt.load(tmp_path / "c", eqx.nn.inference_mode(net))
    assert loaded.layers[1].inference is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert eqxckpt.load(tmp_path / "c", net).layers[1].inference is False  # the same flag: silent


def test_every_format_opens_as_an_exported_source(tmp_path):
    import safetensors.numpy

    eqxckpt.save(tmp_path / "c", {"w": np.ones(2)})
    safetensors.numpy.save_file({"w": np.ones(2)}, str(tmp_path / "m.safetensors"))
    for where in (tmp_path / "c", tmp_path / "m.safetensors"):
        assert isinstance(eqxckpt.open(where), eqxckpt.Source)


def test_the_rules_are_transforms_everywhere():
    original, rules, new = {"a": 1}, {"b": eqxckpt.Transform(original_key="a")}, {"b": 0}
    assert eqxckpt.apply_transformations(original, rules, new) == {"b": 1}
    assert eqxckpt.apply_transformations(original, transforms=rules, new_tree=new) == {"b": 1}
    with pytest.raises(TypeError):
        eqxckpt.apply_transformations(original, transformations=rules, new_tree=new)  # type: ignore[call-arg]


def test_non_strict_says_why_it_could_not_help(tmp_path):
    eqxckpt.save(tmp_path / "c", {"a": np.ones(3, np.float32), "b": np.ones(2, np.float32)})
    like = {"a": np.ones(3, np.float32), "b": np.ones(5, np.float32), "c": jax.ShapeDtypeStruct((4,), jnp.float32)}
    with pytest.raises(eqxckpt.StructureMismatchError) as info:
        eqxckpt.load(tmp_path / "c", like, strict=False)
    message = str(info.value)
    assert "`like` has no value for the missing leaves above: they are shapes only (jax.ShapeDtypeStruct" in message
    assert "a freshly initialised model" in message
    assert "a leaf whose shape, dtype or kind differs from `like`'s is still an error" in message
    assert "strict=False keeps `like`'s values for missing leaves" not in message  # no longer offered as the fix
    # Strict, the same skeleton is told what strict=False would do instead.
    with pytest.raises(eqxckpt.StructureMismatchError, match="strict=False keeps `like`'s values") as info:
        eqxckpt.load(tmp_path / "c", like)
    assert "shapes only" not in str(info.value)


def test_a_type_checker_knows_what_load_returns(tmp_path):
    """``load(path, like)`` is typed as ``like``'s type (a constructor's result's), and
    ``load(path)`` as Any: checked by pyright on a file of `assert_type` lines."""
    pyright = pyright_path()
    package_root = pathlib.Path(eqxckpt.__file__).resolve().parents[1]
    config = {"extraPaths": [str(package_root)], "typeCheckingMode": "standard"}
    (tmp_path / "pyrightconfig.json").write_text(json.dumps(config))
    (tmp_path / "check.py").write_text(
        textwrap.dedent("""
            from typing import Any, assert_type

            import equinox as eqx
            import jax
            import jax.numpy as jnp

            import eqxckpt

            model = eqx.nn.MLP(2, 2, 8, 2, key=jax.random.key(0))
            assert_type(eqxckpt.load("ckpt", model), eqx.nn.MLP)
            assert_type(eqxckpt.load("ckpt", model, at="model", cast=True, progress=True), eqx.nn.MLP)
            assert_type(eqxckpt.load("ckpt", lambda: model, at="model"), eqx.nn.MLP)
            assert_type(eqxckpt.load(eqxckpt.open("ckpt"), {"w": jnp.zeros(2)}), dict[str, jax.Array])
            assert_type(eqxckpt.load("ckpt"), Any)
            assert_type(eqxckpt.load("ckpt", None, at="model"), Any)
        """)
    )
    done = subprocess.run(
        [str(pyright), "--pythonpath", sys.executable, "check.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("budget", [-1, "1G"])
def test_a_bad_host_memory_budget_is_an_argument_error(tmp_path, budget):
    # load's own argument: ArgumentError ("bad arguments in save/load/manager"), not a plain CheckpointError.
    eqxckpt.save(tmp_path / "c", {"w": np.ones(3, np.float32)})
    with pytest.raises(eqxckpt.ArgumentError, match="host_memory_budget"):
        eqxckpt.load(tmp_path / "c", None, host_memory_budget=budget)


@pytest.mark.parametrize("path", ["whole", "placed", "placed-in-bands"])
def test_a_load_refuses_chunks_swapped_between_leaves(tmp_path, monkeypatch, path):
    """Each chunk passes its CRC-32C after the swap; the leaf's digest, checked as its bytes
    are read (whole, or block by block as they are placed), does not: a load never returns
    another leaf's bytes (before, it returned them)."""
    from eqxckpt._read import _place

    tree = {"p": np.zeros((300, 300), np.float32), "q": np.ones((300, 300), np.float32)}
    eqxckpt.save(tmp_path / "c", tree)
    p, q = tmp_path / "c/p/c/0/0", tmp_path / "c/q/c/0/0"
    p_bytes, q_bytes = p.read_bytes(), q.read_bytes()
    p.write_bytes(q_bytes)
    q.write_bytes(p_bytes)
    like = {k: jnp.zeros_like(v) for k, v in tree.items()}
    budget = None
    if path != "whole":
        monkeypatch.setattr(_place, "STAGE_CPU", True)  # a GPU's path: the leaf is placed
        budget = 64 << 10 if path == "placed-in-bands" else None
    with pytest.raises(eqxckpt.CorruptCheckpointError, match=r"'p'.*not the bytes saved.*Restore it from a copy"):
        eqxckpt.load(tmp_path / "c", like, host_memory_budget=budget)
    # The bytes put back, it loads.
    p.write_bytes(p_bytes)
    q.write_bytes(q_bytes)
    loaded = eqxckpt.load(tmp_path / "c", like, host_memory_budget=budget)
    assert all(np.array_equal(loaded[k], v) for k, v in tree.items())


def test_enum_and_numpy_str_leaves_come_back_as_the_type_like_holds(tmp_path):
    """#53 item 6: an IntEnum, a (str, Enum) and np.str_ came back as plain int and str even
    when `like` held the original type (`.name`, `isinstance`, `type(x) is` broke); a value
    that is no member of like's enum is a mismatch row, not a ValueError."""
    import enum

    class Color(enum.IntEnum):
        RED = 1

    class Mode(str, enum.Enum):  # noqa: UP042 - the (str, Enum) users write, which StrEnum is not
        A = "a"

    class Other(enum.IntEnum):
        X = 5

    eqxckpt.save(tmp_path / "c", {"c": Color.RED, "m": Mode.A, "s": np.str_("x"), "i": 3})
    out = eqxckpt.load(tmp_path / "c", {"c": Color.RED, "m": Mode.A, "s": np.str_("y"), "i": 0})
    assert out["c"] is Color.RED and out["m"] is Mode.A and type(out["s"]) is np.str_ and out["s"] == "x"
    assert type(out["i"]) is int and out["i"] == 3
    assert {k: type(v) for k, v in eqxckpt.load(tmp_path / "c").items()} == {"c": int, "m": str, "s": str, "i": int}
    with pytest.raises(eqxckpt.StructureMismatchError, match="c: int = 1 is no member of .*Other"):
        eqxckpt.load(tmp_path / "c", {"c": Other.X, "m": Mode.A, "s": "", "i": 0})

    # The final outside attack: an enum whose lookup maps a value to another member (a flag's
    # bits, a `_missing_` that lowercases or clamps) or raises something else changed the
    # value silently or raised a raw TypeError; each is a mismatch row, the value never changed.
    class Flag(enum.IntFlag):
        A = 1
        B = 2

    class Lower(str, enum.Enum):  # noqa: UP042 - the (str, Enum) users write
        a = "a"

        @classmethod
        def _missing_(cls, value):
            return cls(value.lower())

    class Raises(enum.IntEnum):
        A = 1

        @classmethod
        def _missing_(cls, value):
            raise TypeError(value)

    class Text(np.str_):
        pass

    eqxckpt.save(tmp_path / "d", {"f": -1, "s": "A", "r": 9, "ok": 3, "t": "q"})
    for like in ({"f": Flag.A}, {"s": Lower.a}, {"r": Raises.A}):
        with pytest.raises(eqxckpt.StructureMismatchError, match="is no member of"):
            eqxckpt.load(tmp_path / "d", {"f": 0, "s": "", "r": 0, "ok": 0, "t": "", **like})
    out = eqxckpt.load(tmp_path / "d", {"f": 0, "s": "", "r": 0, "ok": Flag.A, "t": Text("x")})
    assert out["ok"] == Flag.A | Flag.B and type(out["ok"]) is Flag and type(out["t"]) is Text and out["t"] == "q"
