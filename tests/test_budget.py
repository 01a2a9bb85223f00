"""Host memory (`_budget`): the budget a restore holds beyond its result, the read window
that follows from it, and refusing allocations beyond what the machine has left."""

import numpy as np
import pytest

import eqxckpt
import eqxckpt._budget as budget_module
from eqxckpt._budget import (
    DEFAULT_HOST_MEMORY_BUDGET,
    MIN_READ_WINDOW,
    available_memory,
    check_allocation,
    host_memory_budget,
    limited_host_memory,
    read_window,
)


def test_the_read_window_is_a_quarter_between_its_floor_and_the_budget():
    assert host_memory_budget() == DEFAULT_HOST_MEMORY_BUDGET
    assert read_window(0) == MIN_READ_WINDOW
    assert read_window(400 << 20) == 100 << 20
    assert read_window(100 << 30) == DEFAULT_HOST_MEMORY_BUDGET
    with limited_host_memory(1 << 20):  # a budget below the floor is kept to
        assert host_memory_budget() == 1 << 20
        assert read_window(1 << 30) == 1 << 20
        with limited_host_memory(None):
            assert host_memory_budget() == DEFAULT_HOST_MEMORY_BUDGET
        assert host_memory_budget() == 1 << 20
    assert host_memory_budget() == DEFAULT_HOST_MEMORY_BUDGET


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "1"])
def test_a_budget_that_is_not_a_positive_number_of_bytes_is_refused(tmp_path, bad):
    eqxckpt.save(tmp_path / "c", {"w": np.ones(3)})
    with pytest.raises(eqxckpt.CheckpointError, match="host_memory_budget must be a positive number of bytes"):
        eqxckpt.load(tmp_path / "c", host_memory_budget=bad)
    assert host_memory_budget() == DEFAULT_HOST_MEMORY_BUDGET


def test_an_allocation_beyond_the_memory_left_is_refused(monkeypatch):
    monkeypatch.setattr(budget_module, "available_memory", lambda: 1000)
    check_allocation(1000, "Reading leaf 'w'")
    with pytest.raises(eqxckpt.CheckpointError, match="Reading leaf 'w' needs .* GiB of host memory"):
        check_allocation(1001, "Reading leaf 'w'")
    monkeypatch.setattr(budget_module, "available_memory", lambda: None)  # unknown: allowed
    check_allocation(1 << 60, "Reading leaf 'w'")


def test_available_memory_is_what_the_kernel_reports():
    available = available_memory()
    assert available is None or available > 0
