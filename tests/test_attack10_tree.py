"""Attack 10: `_tree.flatten`'s error for dicts whose keys JAX cannot sort."""

import collections

import jax.tree_util as jtu
import numpy as np
import pytest

import eqxckpt


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
