"""eqxckpt/_tree.py: `is_array_like` remembers its answers per type, never wrongly."""

import re

import jax
import jax.numpy as jnp
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
