"""eqxckpt/_tree.py: `is_array_like` remembers its answers per type, never wrongly."""

import jax
import jax.numpy as jnp
import numpy as np

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
