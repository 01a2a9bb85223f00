import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_trees_equal

import eqxckpt
from eqxckpt import Transform, apply_transformations
from eqxckpt._stored import StoredArrays

NESTED = {"a": 1, "dense_1": {"kernel": 2, "bias": 3}, "dense_2": {"kernel": 4, "bias": 5}}


def test_rename():
    out = apply_transformations(
        {"a": 1, "b": 2}, {"a2": Transform(original_key="a"), "b2": Transform(original_key="b")}, {"a2": ..., "b2": ...}
    )
    assert out == {"a2": 1, "b2": 2}


def test_regex_rename_with_backreferences():
    out = apply_transformations(
        {"a1": 1, "b5": 2}, {r"([a-z])_([0-9])": Transform(original_key=r"\1\2")}, {"a_1": ..., "b_5": ...}
    )
    assert out == {"a_1": 1, "b_5": 2}


def test_named_groups():
    out = apply_transformations(
        {"a1": 1}, {r"(?P<l>[a-z])_(?P<n>[0-9])": Transform(original_key=r"\g<l>\g<n>")}, {"a_1": ...}
    )
    assert out == {"a_1": 1}


@pytest.mark.parametrize(
    "rules",
    [
        {
            r"([a-z]+)_NEW": Transform(original_key=r"\1"),
            r"([a-z]+)_([0-9])_NEW/([a-z]+)_1": Transform(original_key=r"\1_\2/\3"),
        },
        {
            r"([a-z]+)_NEW": Transform(original_key=r"\1"),
            r"([a-z]+)_([0-9])_NEW": {"([a-z]+)_1": Transform(original_key=r"\1_\2/\3")},
        },
    ],
    ids=["flat", "nested"],
)
def test_nested_rename(rules):
    new = {
        "a_NEW": ...,
        "dense_1_NEW": {"kernel_1": ..., "bias_1": ...},
        "dense_2_NEW": {"kernel_1": ..., "bias_1": ...},
    }
    assert apply_transformations(NESTED, rules, new) == {
        "a_NEW": 1,
        "dense_1_NEW": {"kernel_1": 2, "bias_1": 3},
        "dense_2_NEW": {"kernel_1": 4, "bias_1": 5},
    }


def test_value_change():
    rules = {"a": Transform(value_fn=lambda v: v * 2), "b2": Transform(value_fn=lambda v: v * 3, original_key="b")}
    assert apply_transformations({"a": 1, "b": 2}, rules, {"a": ..., "b2": ...}) == {"a": 2, "b2": 6}


def test_regex_value_change():
    rules = {
        r"a([0-9]?)\*2": Transform(value_fn=lambda v: v * 2, original_key=r"a\1"),
        r"b([0-9]?)\*3": Transform(value_fn=lambda v: v * 3, original_key=r"b\1"),
    }
    out = apply_transformations({"a1": 1, "a2": 2, "b": 3}, rules, {"a1*2": ..., "a2*2": ..., "b*3": ...})
    assert out == {"a1*2": 2, "a2*2": 4, "b*3": 9}


def test_flatten_nested_structure():
    rules = {
        r"([a-z]+)": Transform(original_key=r"\1"),
        r"([a-z]+)_([0-9])_([a-z]+)": Transform(original_key=r"\1_\2/\3"),
    }
    new = dict.fromkeys(["a", "dense_1_kernel", "dense_1_bias", "dense_2_kernel", "dense_2_bias"], ...)
    assert apply_transformations(NESTED, rules, new) == {
        "a": 1,
        "dense_1_kernel": 2,
        "dense_1_bias": 3,
        "dense_2_kernel": 4,
        "dense_2_bias": 5,
    }


def test_multi_value_combine():
    original = {"a": np.array([1, 2, 3, 4]), "b": {"c": np.array([5, 6, 7, 8])}}
    rules = {
        "a": Transform(multi_value_fn=lambda _, kv: kv["a"][-1]),
        "b": {"c": Transform(multi_value_fn=lambda _, kv: kv["a"] + kv["b"]["c"])},
    }
    out = apply_transformations(original, rules, {"a": ..., "b": {"c": ...}})
    assert out["a"] == 4 and out["b"]["c"].tolist() == [6, 8, 10, 12]


def test_average_weights():
    original = {"a": {"a_1": 1, "a_2": 2}, "b": {"b_1": 3, "b_2": 4, "b_3": 5}}
    rules = {r"([a-z]+)": Transform(multi_value_fn=lambda k, kv: sum(kv[k].values()) / len(kv[k]))}
    assert apply_transformations(original, rules, {"a": ..., "b": ...}) == {"a": 1.5, "b": 4.0}


def test_insert_new_layer_0_and_shift():
    dense = lambda v: {"kernel": v, "bias": -v}  # noqa: E731
    original = {"params": {"Dense_0": dense(10), "Dense_1": dense(11)}, "step": 7}
    new = {"params": {f"Dense_{i}": dense(100 + i) for i in range(4)}, "step": 0}
    rules = {
        r"(.*)Dense_0(.*)": Transform(use_fallback=True),
        r"(.*)Dense_1(.*)": Transform(original_key=r"\1Dense_0\2"),
        r"(.*)Dense_2(.*)": Transform(original_key=r"\1Dense_1\2"),
    }
    out = apply_transformations(original, rules, new)
    assert out == {
        "params": {"Dense_0": dense(100), "Dense_1": dense(10), "Dense_2": dense(11), "Dense_3": dense(103)},
        "step": 7,
    }


def test_default_to_original_false():
    original = {"a": 1, "b": 2, "gone": 3}
    new = {"a": 10, "b": 20, "c": 30}
    assert apply_transformations(original, {}, new) == {"a": 1, "b": 2, "c": 30}
    assert apply_transformations(original, {}, new, default_to_original=False) == {"a": 10, "b": 20, "c": 30}
    # the fallback is then the original tree
    rules = {"b": Transform(use_fallback=True)}
    assert apply_transformations(original, rules, new, default_to_original=False) == {"a": 10, "b": 2, "c": 30}


def test_equinox_modules_in_memory():
    old = eqx.nn.MLP(4, 3, 16, 2, key=jax.random.key(0))
    new = eqx.nn.MLP(4, 3, 16, 3, key=jax.random.key(1))
    rules = {r"layers/2/(.*)": Transform(use_fallback=True), r"layers/3/(.*)": Transform(original_key=r"layers/2/\1")}
    out = apply_transformations(old, rules, new)
    assert out.layers[0].weight is old.layers[0].weight and out.layers[2].weight is new.layers[2].weight
    assert out.layers[3].weight is old.layers[2].weight and out.activation is new.activation


def test_bad_regex():
    with pytest.raises(eqxckpt.TransformError, match="not a valid regex"):
        apply_transformations({"a": 1}, {"a(": Transform()}, {"a": ...})


def test_backreference_to_missing_group():
    with pytest.raises(eqxckpt.TransformError, match=r"\\3.*backreferences"):
        apply_transformations({"a": 1}, {r"(a)_(b)": Transform(original_key=r"\3")}, {"a_b": ...})


def test_rule_pointing_at_nothing():
    with pytest.raises(eqxckpt.TransformError, match="'x' <- 'nope'"):
        apply_transformations({"a": 1}, {"x": Transform(original_key="nope")}, {"x": ...})


# --- at load time ---------------------------------------------------------------------


@pytest.fixture
def saved_state(tmp_path):
    model = eqx.nn.MLP(4, 3, 16, 2, key=jax.random.key(0))
    opt_state = optax.adam(1e-3).init(eqx.filter(model, eqx.is_array))
    eqxckpt.save(tmp_path / "c", {"model": model, "opt_state": opt_state, "old_head": jnp.ones(5)})
    return tmp_path / "c", model


def _count_reads(monkeypatch):
    read = []
    real = StoredArrays.open_metadata
    monkeypatch.setattr(StoredArrays, "open_metadata", lambda self, r: (read.append(r.path), real(self, r))[1])
    return read


def test_load_inserts_a_layer_and_reads_only_what_it_keeps(saved_state, monkeypatch):
    path, old = saved_state
    shutil.rmtree(path / "old_head")  # dropped by the rules: never read
    new = eqx.nn.MLP(4, 3, 16, 3, key=jax.random.key(5))
    rules = {r"layers/2/(.*)": Transform(use_fallback=True), r"layers/3/(.*)": Transform(original_key=r"layers/2/\1")}
    read = _count_reads(monkeypatch)
    out = eqxckpt.load(path, new, at="model", transforms=rules)
    assert sorted(read) == sorted(f"model/layers/{i}/{n}" for i in (0, 1, 2) for n in ("weight", "bias"))
    np.testing.assert_array_equal(out.layers[3].weight, old.layers[2].weight)
    np.testing.assert_array_equal(out.layers[2].weight, new.layers[2].weight)
    np.testing.assert_array_equal(out.layers[0].bias, old.layers[0].bias)


def test_empty_transforms_is_partial_restore(saved_state, monkeypatch):
    path, old = saved_state
    shutil.rmtree(path / "opt_state")
    read = _count_reads(monkeypatch)
    out = eqxckpt.load(path, {"model": eqx.filter_eval_shape(lambda: old)}, transforms={})
    assert_trees_equal(out["model"], old)
    assert all(p.startswith("model/") for p in read) and len(read) == 6


def test_value_fn_and_lazy_multi_value_fn(saved_state):
    path, old = saved_state
    seen = []

    def combine(key, tree):
        seen.append(type(tree["model"]["layers"][0]["weight"]))
        return tree["model"]["layers"][0]["bias"].get() + tree["old_head"].get()[0]

    like = {"w_half": jax.ShapeDtypeStruct((16, 4), jnp.bfloat16), "b_plus": jax.ShapeDtypeStruct((16,), jnp.float32)}
    rules = {
        "w_half": Transform(original_key="model/layers/0/weight", value_fn=lambda w: w.astype(jnp.bfloat16) / 2),
        "b_plus": Transform(multi_value_fn=combine),
    }
    out = eqxckpt.load(path, like, transforms=rules)
    assert seen == [eqxckpt.LazyArray]
    assert out["w_half"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(out["w_half"], (old.layers[0].weight.astype(jnp.bfloat16) / 2))
    np.testing.assert_array_equal(out["b_plus"], old.layers[0].bias + 1)


def test_unsupplied_like_leaf_is_an_error(saved_state):
    path, _ = saved_state
    like = {"model": eqx.filter_eval_shape(lambda: eqx.nn.MLP(4, 3, 16, 3, key=jax.random.key(0)))}
    with pytest.raises(
        eqxckpt.StructureMismatchError, match=r"model/layers/3/weight: expected float32\[3,16\]; no rule"
    ):
        eqxckpt.load(path, like, transforms={})
    with pytest.raises(eqxckpt.StructureMismatchError, match="not in the checkpoint"):
        eqxckpt.load(path, {"x": jnp.ones(2)}, transforms={"x": Transform(original_key="model/nope")})
    with pytest.raises(eqxckpt.StructureMismatchError, match="produced shape"):  # untraceable: checked once run
        eqxckpt.load(
            path,
            {"x": jnp.ones(2)},
            transforms={"x": Transform(original_key="old_head", value_fn=lambda v: np.asarray(v).copy())},
        )


def test_a_value_fn_that_misfits_is_in_the_plans_one_error_before_anything_is_read(saved_state, monkeypatch):
    """The shape a value_fn gives is traced from the stored shape, so its misfit is listed
    with every other difference and nothing is read."""
    path, _ = saved_state
    read = _count_reads(monkeypatch)
    like = {"x": jnp.ones(2), "w": jnp.ones((3, 16)), "gone": jnp.ones(1)}
    rules = {
        "x": Transform(original_key="old_head", value_fn=lambda v: v[:3]),
        "w": Transform(original_key="model/layers/0/weight", value_fn=np.transpose),
        "gone": Transform(original_key="model/nope"),
    }
    with pytest.raises(eqxckpt.StructureMismatchError) as e:
        eqxckpt.load(path, like, transforms=rules)
    assert dict(e.value.mismatched) == {
        "x": "expected float32[2], found float32[5], which value_fn makes shape [3] (from 'old_head')",
        "w": "expected float32[3,16], found float32[16,4], which value_fn makes shape [4, 16] "
        "(from 'model/layers/0/weight')",
        "gone": "rule points at 'model/nope', which is not in the checkpoint",
    }
    assert read == []
    like = {"x": jnp.ones(3), "w": jnp.ones((4, 16))}
    out = eqxckpt.load(path, like, transforms={k: v for k, v in rules.items() if k != "gone"})
    assert out["x"].tolist() == [1.0, 1.0, 1.0] and out["w"].shape == (4, 16)


def test_values_from_rules_meet_the_dtype_rules_of_stored_values(tmp_path):
    """A value a rule computes is held to what a stored value is: a different dtype is
    refused unless cast=True, and a cast that changes the values is refused."""
    eqxckpt.save(tmp_path / "ckpt", {"a": np.full(3, 1e300), "small": np.full(3, 2.5)})
    like = {"b": jnp.zeros(3, jnp.float32)}
    for rule in (
        Transform(original_key="a", value_fn=lambda x: x),
        Transform(multi_value_fn=lambda key, tree: tree["a"].get()),
    ):
        with pytest.raises(eqxckpt.StructureMismatchError, match=r"produced float64\[3\].*Pass cast=True") as e:
            eqxckpt.load(tmp_path / "ckpt", like, transforms={"b": rule})
        assert e.value.mismatched == [("b", "produced float64[3] (pass cast=True to convert)")]
        with pytest.raises(eqxckpt.CastError, match="infinities"):
            eqxckpt.load(tmp_path / "ckpt", like, cast=True, transforms={"b": rule})
    fits = Transform(original_key="small", value_fn=lambda x: x * 2)
    restored = eqxckpt.load(tmp_path / "ckpt", like, cast=True, transforms={"b": fits})["b"]
    assert restored.dtype == jnp.float32 and restored.tolist() == [5.0, 5.0, 5.0]
    # Into numpy leaves, and integers out of range.
    with pytest.raises(eqxckpt.StructureMismatchError, match="Pass cast=True"):
        eqxckpt.load(tmp_path / "ckpt", {"b": np.zeros(3, np.float32)}, transforms={"b": fits})
    with pytest.raises(eqxckpt.CastError, match="outside"):
        eqxckpt.load(
            tmp_path / "ckpt",
            {"b": np.zeros(3, np.int8)},
            cast=True,
            transforms={"b": Transform(original_key="small", value_fn=lambda x: x * 100)},
        )
