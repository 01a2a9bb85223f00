"""Arguments of the public API (`_arguments.checked_arguments`): of the wrong type, each is
an `ArgumentError` naming it; never a bare `TypeError`, `AttributeError` or `NameError`
from deep inside, nor a value silently taken for another (``overwrite="no"``)."""

import itertools
import warnings

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import eqxckpt

_count = itertools.count()

# Each public call, given a checkpoint directory, with its keyword arguments: which are
# flags (a bool and nothing else), which take anything of the right type.
FLAGS = {
    "save": ["overwrite", "blocking"],
    "load": ["strict", "cast", "default_to_original"],
    "save_safetensors": ["overwrite"],
    "CheckpointManager": ["blocking", "save_on_preemption", "exit_on_preemption", "incremental"],
}
OTHERS = {
    "save": ["metadata", "progress", "base"],
    "load": ["at", "transforms", "format", "progress", "host_memory_budget"],
    "open": ["format"],
    "verify": ["progress"],
    "diff": ["at", "progress"],
    "save_safetensors": ["metadata", "progress"],
    "CheckpointManager": [
        "max_to_keep",
        "keep_every",
        "save_interval_steps",
        "best_metric",
        "best_mode",
        "keep_best",
        "preemption_signals",
        "preemption_grace_s",
        "local_interval_steps",
        "local_replicas",
        "local_max_to_keep",
    ],
}


def _call(name: str, where, **kwargs) -> None:
    fresh = where / f"new-{next(_count)}"
    tree = {"w": np.arange(3.0)}
    {
        "save": lambda: eqxckpt.save(fresh, tree, **kwargs),
        "load": lambda: eqxckpt.load(where / "c", **kwargs),
        "open": lambda: eqxckpt.open(where / "c", **kwargs),
        "verify": lambda: eqxckpt.verify(where / "c", **kwargs),
        "diff": lambda: eqxckpt.diff(where / "c", where / "c", **kwargs),
        "save_safetensors": lambda: eqxckpt.save_safetensors(f"{fresh}.safetensors", tree, **kwargs),
        "CheckpointManager": lambda: eqxckpt.CheckpointManager(fresh, **kwargs).close(),
    }[name]()


WRONG = st.one_of(
    st.integers(-3, 3),
    st.floats(allow_nan=True),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.builds(object),
    st.just(np.float32(1.0)),
)


@pytest.fixture(scope="module")
def where(tmp_path_factory):
    path = tmp_path_factory.mktemp("arguments")
    eqxckpt.save(path / "c", {"w": np.arange(3.0), "n": 1})
    return path


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_flag_of_any_other_type_is_an_argument_error_naming_it(where, data):
    name = data.draw(st.sampled_from(sorted(FLAGS)))
    flag = data.draw(st.sampled_from(FLAGS[name]))
    value = data.draw(WRONG.filter(lambda v: not isinstance(v, (bool, np.bool_))))
    with pytest.raises(eqxckpt.ArgumentError, match=f"{flag} must be True or False"):
        _call(name, where, **{flag: value})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_argument_of_the_public_api_is_taken_or_refused_with_a_checkpoint_error(where, data):
    name = data.draw(st.sampled_from(sorted(OTHERS)))
    argument = data.draw(st.sampled_from(OTHERS[name]))
    value = data.draw(WRONG)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            _call(name, where, **{argument: value})
        except eqxckpt.CheckpointError:
            pass  # anything else (TypeError, AttributeError...) fails the test


@pytest.mark.parametrize("call", ["save", "load", "open", "verify", "CheckpointManager"])
def test_a_path_of_the_wrong_type_or_an_unknown_keyword_is_an_argument_error(call, tmp_path):
    calls = {
        "save": lambda *a, **k: eqxckpt.save(*a, {"w": 1}, **k),
        "load": eqxckpt.load,
        "open": eqxckpt.open,
        "verify": eqxckpt.verify,
        "CheckpointManager": eqxckpt.CheckpointManager,
    }
    with pytest.raises(eqxckpt.ArgumentError, match="path|directory"):
        calls[call](5)
    with pytest.raises(eqxckpt.ArgumentError, match="unexpected keyword argument 'overwrit'"):
        calls[call](tmp_path / "x", overwrit=True)
