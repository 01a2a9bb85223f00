"""eqxckpt/_tree.py: `is_array_like` remembers its answers per type, never wrongly."""

import collections
import re

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import eqxckpt
from eqxckpt._tree import is_array_like, is_empty_subtree


def test_a_tracer_that_is_no_array_does_not_make_array_tracers_no_arrays():
    seen = []

    def f(x):
        seen.append(is_array_like(jax.lax.create_token()))  # a tracer of the same type as x's
        seen.append(is_array_like(x))
        seen.append(is_empty_subtree(x))
        return x

    jax.jit(f)(jnp.ones(2))
    assert seen == [False, True, False]
    assert is_array_like(np.ones(2)) and is_array_like(jnp.ones(2)) and not is_array_like(np.str_("a"))


@pytest.mark.parametrize(
    "tree, where",
    [({1: np.ones(2), "1x": np.zeros(2)}, "<root>"), ({"a": [{"b": {2: 1, "x": np.ones(1)}}]}, "['a'][0]['b']")],
)
def test_a_dict_whose_keys_cannot_be_sorted_is_named(tmp_path, tree, where):
    """JAX sorts a dict's keys to flatten it: keys that do not compare (1 and "1x") fail
    inside JAX. save and load (into it as ``like``) say which dict; nothing is written."""
    eqxckpt.save(tmp_path / "other", {"w": np.ones(2)})
    for call in (lambda: eqxckpt.save(tmp_path / "c", tree), lambda: eqxckpt.load(tmp_path / "other", tree)):
        with pytest.raises(
            eqxckpt.ArgumentError, match=rf"The dict at {re.escape(where)} has keys JAX cannot put in order"
        ):
            call()
        assert not (tmp_path / "c").exists()


@jtu.register_pytree_node_class
class Refuses:
    """A user's pytree node whose flattening fails with its own ValueError."""

    def tree_flatten(self):
        raise ValueError("Refuses cannot be flattened: its buffers were freed")

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls()


def test_an_ordered_dict_jax_flattens_is_not_blamed_for_an_error_inside_it(tmp_path):
    """JAX keeps an OrderedDict's keys in insertion order (it never sorts them): one with
    keys 1 and "a" flattens. The error inside it is the user's node's, and must be what
    the user sees, not "keys JAX cannot put in order"."""
    x = np.zeros(2, np.float32)
    eqxckpt.save(tmp_path / "ok", {"od": collections.OrderedDict([(1, x), ("a", x)])})  # it is fine alone
    tree = {"od": collections.OrderedDict([(1, Refuses()), ("a", x)])}
    with pytest.raises(ValueError) as raised:
        eqxckpt.save(tmp_path / "bad", tree)
    assert "cannot be flattened: its buffers were freed" in str(raised.value), raised.value


def test_a_defaultdict_with_unsortable_keys_is_named_like_a_dict(tmp_path):
    x = np.zeros(2, np.float32)
    with pytest.raises(eqxckpt.ArgumentError, match=r"\['d'\].*1, 'a'"):
        eqxckpt.save(tmp_path / "dd", {"d": collections.defaultdict(int, {1: x, "a": x})})
