"""Events reported through `jax.monitoring` (`_monitoring`)."""

import jax.monitoring
import numpy as np
import pytest

import eqxckpt
from eqxckpt._monitoring import (
    EVENTS,
    LOAD_BYTES,
    LOAD_DURATION,
    PREFIX,
    SAVE_BLOCKED,
    SAVE_BYTES,
    SAVE_COMMITTED,
)


@pytest.fixture
def events():
    """Every eqxckpt event reported while the test runs, in order: ``(name, value)``."""
    heard: list[tuple[str, float]] = []

    def duration(event: str, secs: float, **kwargs) -> None:
        if event.startswith(PREFIX + "/"):
            heard.append((event, secs))

    def scalar(event: str, value: float, **kwargs) -> None:
        if event.startswith(PREFIX + "/"):
            heard.append((event, value))

    jax.monitoring.register_event_duration_secs_listener(duration)
    jax.monitoring.register_scalar_listener(scalar)
    yield heard
    jax.monitoring.unregister_event_duration_listener(duration)
    jax.monitoring.unregister_scalar_listener(scalar)


def test_a_blocking_save_and_a_load_report_their_times_and_bytes(tmp_path, events):
    tree = {"w": np.ones((256, 64), np.float32), "b": np.zeros(3, np.int8), "step": 3}
    eqxckpt.save(tmp_path / "c", tree)
    names = [name for name, _ in events]
    assert names == [SAVE_COMMITTED, SAVE_BYTES, SAVE_BLOCKED]
    got = dict(events)
    assert got[SAVE_BYTES] == 256 * 64 * 4 + 3
    assert 0 < got[SAVE_COMMITTED] <= got[SAVE_BLOCKED]
    events.clear()
    eqxckpt.load(tmp_path / "c", tree, at=None)
    assert [name for name, _ in events] == [LOAD_BYTES, LOAD_DURATION]
    assert dict(events)[LOAD_BYTES] == 256 * 64 * 4 + 3 and dict(events)[LOAD_DURATION] > 0
    events.clear()
    eqxckpt.load(tmp_path / "c", at="b")  # only what it read
    assert dict(events)[LOAD_BYTES] == 3


def test_a_background_save_reports_the_time_the_caller_was_blocked_before_the_commit(tmp_path, events):
    handle = eqxckpt.save(tmp_path / "c", {"w": np.ones(1 << 20, np.float32)}, blocking=False)
    handle.wait()
    assert [name for name, _ in events][0] == SAVE_BLOCKED
    got = dict(events)
    assert set(got) == {SAVE_BLOCKED, SAVE_COMMITTED, SAVE_BYTES} and got[SAVE_BYTES] == 4 << 20
    assert got[SAVE_BLOCKED] <= got[SAVE_COMMITTED]


def test_a_step_sharing_its_base_reports_only_the_bytes_it_wrote(tmp_path, events):
    frozen, head = np.arange(1 << 16, dtype=np.float32), np.ones(8, np.float32)
    eqxckpt.save(tmp_path / "1", {"frozen": frozen, "head": head})
    events.clear()
    eqxckpt.save(tmp_path / "2", {"frozen": frozen, "head": head + 1}, base=tmp_path / "1")
    assert dict(events)[SAVE_BYTES] == head.nbytes


def test_a_failed_save_reports_no_commit(tmp_path, events):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "thesis.tex").write_text("precious")
    with pytest.raises(eqxckpt.CheckpointError):
        eqxckpt.save(tmp_path / "c", {"w": np.ones(3)}, overwrite=True)
    assert SAVE_COMMITTED not in dict(events)


def test_every_event_is_named_in_the_docs():
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / "guides" / "manager.md").read_text()
    for event in EVENTS:
        assert f"`{event}`" in text
