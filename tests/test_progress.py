"""Progress on long work: on a terminal, for large or slow work by default; silent
elsewhere."""

import io
import sys

import numpy as np
import pytest
from conftest import run_cli

import eqxckpt
import eqxckpt._progress as progress_module


def state():
    return {
        "model": {"w": np.ones((256, 64), np.float32), "b": np.zeros(64, np.float32)},
        "opt": {"m": np.ones((512, 64), np.float32)},
        "step": 3,
    }


def test_callbacks_see_every_leaf_and_byte(tmp_path):
    calls = []
    eqxckpt.save(tmp_path / "c", state(), progress=lambda *counts: calls.append(counts))
    total = (256 * 64 + 64 + 512 * 64) * 4
    assert calls[-1] == (total, total, 3, 3) and len(calls) == 3
    assert [c[0] for c in calls] == sorted(c[0] for c in calls)

    calls.clear()
    eqxckpt.load(tmp_path / "c", at="model", progress=lambda *counts: calls.append(counts))
    model_bytes = (256 * 64 + 64) * 4
    assert calls[-1] == (model_bytes, model_bytes, 2, 2)  # only what is read

    calls.clear()
    report = eqxckpt.verify(tmp_path / "c", progress=lambda *counts: calls.append(counts))
    assert report.ok and calls[-1] == (total, total, 3, 3)

    calls.clear()
    eqxckpt.save(tmp_path / "d", state(), blocking=False, progress=lambda *counts: calls.append(counts)).wait()
    assert calls[-1] == (total, total, 3, 3)


def test_silent_by_default_and_without_a_terminal(tmp_path, capfd):
    eqxckpt.save(tmp_path / "c", state())
    eqxckpt.load(tmp_path / "c")
    eqxckpt.save(tmp_path / "d", state(), progress=True)  # stderr is captured: not a terminal
    eqxckpt.load(tmp_path / "d", progress=True)
    eqxckpt.verify(tmp_path / "d", progress=True)
    out, err = capfd.readouterr()
    assert out == "" and err == ""


@pytest.mark.multiprocess
def test_cli_shows_a_bar_on_a_terminal_only(tmp_path):
    eqxckpt.save(tmp_path / "c", state())
    for args in (("verify", str(tmp_path / "c")), ("convert", str(tmp_path / "c"), str(tmp_path / "copy"))):
        status, out, _ = run_cli(*args, terminal=True)
        assert status == 0 and "3/3 leaves" in out, out
        status, out, err = run_cli(*(args[:-1] + (str(tmp_path / "copy2"),) if args[0] == "convert" else args))
        assert status == 0 and "leaves" not in err and "━" not in out + err, out + err


@pytest.mark.multiprocess
@pytest.mark.tf
def test_t5_imports_report_through_the_same_progress(tmp_path):
    import pathlib

    from eqxckpt import t5

    fixture = pathlib.Path(__file__).parent / "fixtures" / "t5_v1_1_tiny"
    calls = []
    t5.load_hf(fixture / "hf", progress=lambda *counts: calls.append(counts))
    assert len(calls) == 52 and calls[-1][0] == calls[-1][1] and calls[-1][2:] == (52, 52)
    # From HuggingFace's layout: the bar is the CLI's, whichever source (no TensorFlow to start).
    status, out, _ = run_cli("import-t5", str(fixture / "hf"), str(tmp_path / "t5"), terminal=True)
    assert status == 0 and "saving" in out and "leaves" in out, out


class Stop(Exception):
    """The user's own exception, raised from a progress callback."""


def test_an_exception_from_the_progress_callback_comes_through_as_itself(tmp_path):
    def stop_after_one(done_bytes, total_bytes, done_leaves, total_leaves):
        if done_leaves:
            raise Stop("enough")

    tree = {f"w{i}": np.full((64, 1024), i, np.float32) for i in range(4)}
    for blocking in (True, False):
        with pytest.raises(Stop, match="enough"):
            eqxckpt.save(tmp_path / f"ckpt{blocking}", tree, progress=stop_after_one, blocking=blocking).wait()
        assert not (tmp_path / f"ckpt{blocking}").exists()  # nothing committed
    eqxckpt.save(tmp_path / "ok", tree)
    with pytest.raises(Stop, match="enough"):
        eqxckpt.load(tmp_path / "ok", tree, progress=stop_after_one)
    assert [p.name for p in tmp_path.iterdir()] == ["ok"]


def test_safetensors_writes_and_manager_saves_report_progress(tmp_path):
    calls = []
    tree = {"a": np.ones(1000, np.float32), "b": np.zeros(10, np.float32)}
    eqxckpt.save_safetensors(tmp_path / "m.safetensors", tree, progress=lambda *c: calls.append(c))
    assert calls[-1] == (4040, 4040, 2, 2)
    calls.clear()
    with eqxckpt.CheckpointManager(tmp_path / "run", blocking=True) as manager:
        manager.save(0, tree, progress=lambda *c: calls.append(c))
        assert calls and calls[-1][0] == calls[-1][1] and calls[-1][2:] == (2, 2)
        calls.clear()
        manager.load(tree, progress=lambda *c: calls.append(c))
    assert calls and calls[-1][0] == calls[-1][1]


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal, keeping what is written to it."""

    def isatty(self) -> bool:
        return True


def on_terminal(monkeypatch) -> _Terminal:
    """stderr replaced by a terminal (in the test's body: pytest sets its own capture after
    fixtures run)."""
    fake = _Terminal()
    monkeypatch.setattr(sys, "stderr", fake)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.setenv("COLUMNS", "200")
    return fake


def test_auto_is_silent_for_quick_small_work_on_a_terminal(tmp_path, monkeypatch):
    terminal = on_terminal(monkeypatch)
    eqxckpt.save(tmp_path / "c", state())
    eqxckpt.load(tmp_path / "c")
    eqxckpt.verify(tmp_path / "c")
    assert terminal.getvalue() == ""
    eqxckpt.save(tmp_path / "d", state(), progress=True)  # asked for: shown whatever the size
    assert "3/3 leaves" in terminal.getvalue()


@pytest.mark.parametrize("rule", ["large", "slow"])
def test_auto_shows_a_bar_for_large_or_slow_work_the_caller_waits_on(tmp_path, monkeypatch, rule):
    terminal = on_terminal(monkeypatch)
    monkeypatch.setattr(progress_module, "AUTO_MIN_BYTES" if rule == "large" else "AUTO_AFTER_S", 0)
    for work in (
        lambda: eqxckpt.save(tmp_path / "c", state(), overwrite=True),
        lambda: eqxckpt.load(tmp_path / "c"),
        lambda: eqxckpt.verify(tmp_path / "c"),
        lambda: eqxckpt.save_safetensors(tmp_path / "m.safetensors", state()["model"], overwrite=True),
    ):
        terminal.seek(0), terminal.truncate()
        work()
        assert "leaves" in terminal.getvalue(), terminal.getvalue()
    terminal.seek(0), terminal.truncate()
    eqxckpt.save(tmp_path / "b", state(), blocking=False).wait()  # in the background: never
    assert terminal.getvalue() == ""
