"""The manager's retention policy (eqxckpt/_retention.py), tested directly: which steps
`Retention.kept` keeps, and how `Retention.ranked` orders them by a metric."""

import math

import pytest
from hypothesis import given, settings, strategies as st

import eqxckpt
from eqxckpt._run._retention import Retention

counts = st.none() | st.integers(1, 6)
values = st.floats(allow_nan=True, allow_infinity=True)
# Committed steps, each with or without the ranked metric (and with another one).
runs = st.dictionaries(
    st.integers(0, 60),
    st.fixed_dictionaries({}, optional={"loss": values, "other": values}),
    max_size=25,
)


@st.composite
def policies(draw) -> Retention:
    keep_best = draw(counts)
    best_metric = "loss" if keep_best is not None else draw(st.sampled_from([None, "loss"]))
    return Retention(
        max_to_keep=draw(counts),
        keep_every=draw(counts),
        best_metric=best_metric,
        best_mode=draw(st.sampled_from(["min", "max"])),
        keep_best=keep_best,
    )


def protected(retention: Retention, steps) -> set[int]:
    """The steps kept whatever `max_to_keep` says: every `keep_every`-th, and the best."""
    every = {s for s in steps if retention.keep_every is not None and s % retention.keep_every == 0}
    return every | set(retention.ranked(steps)[: retention.keep_best or 0])


@settings(max_examples=300, deadline=None)
@given(policies(), runs)
def test_what_is_kept(retention, steps):
    kept = retention.kept(steps)
    assert kept <= set(steps)
    if retention.max_to_keep is None:
        assert kept == set(steps)  # keep everything
        return
    newest = set(sorted(steps)[-retention.max_to_keep :])
    if steps:
        assert max(steps) in kept  # the newest step is always kept
    assert newest <= kept  # the newest max_to_keep...
    assert protected(retention, steps) <= kept  # ...every keep_every-th and the keep_best best...
    assert len(kept - protected(retention, steps)) <= retention.max_to_keep  # ...and nothing else
    assert kept - protected(retention, steps) <= newest


@settings(max_examples=300, deadline=None)
@given(policies(), runs, st.lists(st.integers(0, 80), max_size=10))
def test_applying_retention_after_each_save_keeps_what_applying_it_once_would(retention, steps, order):
    """The manager applies the rule after each commit to what it kept so far; that keeps
    exactly what the rule keeps of all the steps (a dropped step would never come back)."""
    known: dict[int, dict] = {}
    for step in [*steps, *order]:  # saves in any order (several managers, forced steps)
        metrics = steps.get(step, {})
        known[step] = metrics
        kept = retention.kept(known)
        known = {s: m for s, m in known.items() if s in kept}
    everything = {s: steps.get(s, {}) for s in [*steps, *order]}
    assert set(known) == retention.kept(everything)
    assert retention.kept(known) == set(known)  # what is kept is stable


@settings(max_examples=300, deadline=None)
@given(policies(), runs)
def test_ranking(retention, steps):
    ranked = retention.ranked(steps)
    if retention.best_metric is None:
        assert ranked == []
        return
    assert sorted(ranked) == sorted(s for s, m in steps.items() if "loss" in m)
    sign = 1 if retention.best_mode == "min" else -1
    for better, worse in zip(ranked, ranked[1:]):
        a, b = steps[better]["loss"], steps[worse]["loss"]
        if math.isnan(a):
            assert math.isnan(b)  # NaN ranks last
        elif not math.isnan(b):
            assert sign * a < sign * b or (a == b and better > worse)  # equal: the newer first


@pytest.mark.parametrize("mode,ranked", [("min", [3, 1, 5, 0, 4, 2, 6, 7]), ("max", [6, 2, 4, 0, 5, 1, 3, 7])])
def test_ranking_in_both_modes(mode, ranked):
    accuracy = {0: 0.5, 1: 0.2, 2: 0.7, 3: 0.1, 4: 0.6, 5: 0.3, 6: 0.9, 7: float("nan")}
    retention = Retention(max_to_keep=1, best_metric="acc", best_mode=mode, keep_best=2)
    steps = {s: {"acc": v} for s, v in accuracy.items()}
    assert retention.ranked(steps) == ranked
    assert retention.kept(steps) == {7, *ranked[:2]}


def test_the_documented_example():
    losses = {s: {"loss": abs(s - 7) + 0.5} for s in range(20)}  # best (lowest) at step 7
    retention = Retention(max_to_keep=2, keep_every=5, best_metric="loss", keep_best=1)
    assert retention.kept(losses) == {0, 5, 7, 10, 15, 18, 19}
    assert Retention(max_to_keep=2, keep_every=5).kept({s: {} for s in range(12)}) == {0, 5, 10, 11}


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_to_keep": 0}, "max_to_keep must be a positive int"),
        ({"max_to_keep": 2.0}, "max_to_keep must be a positive int"),
        ({"keep_every": -1}, "keep_every must be a positive int"),
        ({"keep_best": 0, "best_metric": "loss"}, "keep_best must be a positive int"),
        ({"best_mode": "lowest"}, "best_mode must be 'min' or 'max'"),
        ({"keep_best": 1}, "keep_best needs best_metric"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(eqxckpt.ArgumentError, match=match):
        Retention(**kwargs)


@pytest.mark.parametrize("name", ["max_to_keep", "keep_every", "keep_best"])
def test_a_bool_count_is_refused_as_save_interval_steps_is(tmp_path, name):
    # An outside attack: max_to_keep=True was taken as 1 while the other counts refuse bools.
    extra = {"best_metric": "loss"} if name == "keep_best" else {}
    with pytest.raises(eqxckpt.ArgumentError, match=f"{name} must be an int or None, got bool True"):
        eqxckpt.CheckpointManager(tmp_path / "run", **{name: True}, **extra)
