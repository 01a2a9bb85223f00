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


def test_numpy_scalars_mappings_and_lists_are_taken_as_python_values(tmp_path):
    """The eighth outside attack: numpy ints passed the type check and were then refused by
    the value checks; a list of signals or a mapping proxy were refused outright."""
    import signal
    import types

    with eqxckpt.CheckpointManager(
        tmp_path / "run",
        max_to_keep=np.int64(2),
        save_interval_steps=np.uint8(1),
        preemption_grace_s=np.float32(3),
        preemption_signals=[signal.SIGTERM],
        blocking=np.bool_(True),
    ) as manager:
        assert manager.save(0, {"w": np.arange(3.0)}, metadata=types.MappingProxyType({"lr": 0.1}))
        assert manager.metadata(0) == {"lr": 0.1}
    assert eqxckpt.load(tmp_path / "run" / "0", host_memory_budget=np.int64(1 << 30))["w"].tolist() == [0.0, 1.0, 2.0]


def test_a_step_counter_kept_on_a_device_is_taken_as_an_int(tmp_path):
    """A trainer's step is often a 0-d JAX array (``state.step``): taken as its int by the
    manager's counts and `save`; a float or a 1-d one is still an `ArgumentError`."""
    import jax.numpy as jnp

    with eqxckpt.CheckpointManager(tmp_path / "run", max_to_keep=jnp.int32(1), blocking=True) as manager:
        assert manager.max_to_keep == 1 and type(manager.max_to_keep) is int
        assert manager.save(jnp.int32(3), {"w": np.arange(3.0)}, metrics={"loss": jnp.float32(0.5)})
        assert manager.all_steps() == [3]
        for bad in (jnp.float32(4.0), jnp.arange(2)):
            with pytest.raises(eqxckpt.ArgumentError, match="step must be an int"):
                manager.save(bad, {"w": np.arange(3.0)})


@pytest.mark.parametrize(
    "path,match",
    [
        ({"driver": 5}, "driver"),
        ({"driver": "zarr3", "path": "x"}, "driver must be 'file', 'memory', 's3' or 'gcs'"),
        ("/tmp/x\0y", "no NUL"),
        ("", "non-empty"),
    ],
)
def test_a_path_no_storage_can_name_is_an_argument_error(path, match):
    with pytest.raises(eqxckpt.ArgumentError, match=match):
        eqxckpt.load(path)


@pytest.mark.parametrize("signum", [9, 19, 0, -1, 10**30])
def test_a_signal_no_process_can_catch_is_refused_at_once(tmp_path, signum):
    with pytest.raises(eqxckpt.ArgumentError, match="preemption_signals must be signals a process can catch"):
        eqxckpt.CheckpointManager(tmp_path / "run", preemption_signals=(signum,))


@pytest.mark.parametrize(
    "metadata,match",
    [
        ({1: "a", "1": "b"}, "keys must be strings, got 1"),
        ({"a": {None: 1}}, "keys must be strings, got None"),
        ({"a": {False: 1}}, "keys must be strings, got False"),
        ({"a": {1, 2}}, "JSON-serialisable"),
        ({"x": float("nan")}, "JSON-serialisable"),
    ],
)
def test_metadata_json_would_change_is_refused_at_save(tmp_path, metadata, match):
    with pytest.raises(eqxckpt.ArgumentError, match=match):
        eqxckpt.save(tmp_path / "c", {"w": np.arange(3.0)}, metadata=metadata)
    deep: dict = {}
    inner = deep
    for _ in range(2000):
        inner["a"] = inner = {}
    with pytest.raises(eqxckpt.ArgumentError, match="nested more than 100 levels"):
        eqxckpt.save(tmp_path / "c", {"w": np.arange(3.0)}, metadata=deep)
    assert not (tmp_path / "c").exists()


def test_a_tuple_in_metadata_or_an_argument_whose_repr_fails_is_an_argument_error(tmp_path):
    """The ninth outside attack: a tuple in metadata came back as a list; an argument of
    the wrong type whose repr raises gave a bare RuntimeError."""

    class BadRepr:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    with pytest.raises(eqxckpt.ArgumentError, match="tuple"):
        eqxckpt.save(tmp_path / "c", {"w": np.arange(3.0)}, metadata={"a": (1, 2)})
    with pytest.raises(eqxckpt.ArgumentError, match="overwrite must be True or False, got BadRepr"):
        eqxckpt.save(tmp_path / "c", {"w": np.arange(3.0)}, overwrite=BadRepr())  # type: ignore[arg-type]
    assert not (tmp_path / "c").exists()


def test_should_save_checks_its_step_as_save_does(tmp_path):
    """The seventeenth outside attack: `should_save` answered for a 1-d array, a bool and a
    negative step, which `save` refuses."""
    import jax.numpy as jnp

    manager = eqxckpt.CheckpointManager(tmp_path / "run", save_interval_steps=4)
    assert manager.should_save(jnp.int32(8)) is True and manager.should_save(6) is False
    for bad in (jnp.array([8]), jnp.array(True), jnp.array(-2), -4, "8"):
        with pytest.raises(eqxckpt.ArgumentError, match="step must be"):
            manager.should_save(bad)
