"""Planning single-read restores (`eqxckpt._read._read_once`); the restores themselves run
across real processes in tests/test_distributed.py."""

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from eqxckpt._read._read_once import spanning_axes, spread_spec

SQUARE = {"a": 2, "b": 2}


def test_axes_whose_devices_belong_to_different_processes_span_them():
    by_rows = np.array([[0, 0], [1, 1]])  # a 2x2 mesh, a process a row
    assert spanning_axes(("a", "b"), by_rows) == {"a"}
    assert spanning_axes(("a", "b"), np.arange(4).reshape(2, 2)) == {"a", "b"}  # a device a process
    assert spanning_axes(("a", "b"), np.zeros((2, 2), int)) == set()  # one process


@pytest.mark.parametrize(
    "spec, shape, spanning, split",
    [
        (P(), (8, 4), {"a", "b"}, P(("a", "b"))),  # replicated on every process: split 4 ways
        (P("a"), (8, 4), {"a", "b"}, P(("b", "a"))),  # sharded over "a", replicated over "b": "b" major
        (P("a"), (2, 8), {"a", "b"}, P("a", "b")),  # rows too few: the next dimension
        (P(None, "a"), (3, 4), {"b"}, P(None, ("b", "a"))),
        (P(), (8, 4), {"a"}, P("a")),  # "b" stays within a process: only "a" is split
    ],
)
def test_a_replication_axis_spanning_processes_is_split_along_a_dimension_that_divides(spec, shape, spanning, split):
    assert spread_spec(spec, shape, SQUARE, spanning) == split


@pytest.mark.parametrize(
    "spec, shape, spanning, why",
    [
        (P("a", "b"), (8, 4), {"a", "b"}, "nothing replicated"),
        (P("b"), (8, 4), {"b"}, "replicated only within processes"),
        (P(), (8, 4), set(), "one process"),
        (P(), (3, 5), {"a", "b"}, "no dimension divides by 4"),
        (P(), (), {"a", "b"}, "a scalar"),
        (P(), (0, 4), {"a", "b"}, "empty"),
    ],
)
def test_every_process_reads_for_itself_where_nothing_splits(spec, shape, spanning, why):
    assert spread_spec(spec, shape, SQUARE, spanning) is None, why
