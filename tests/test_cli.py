import subprocess
import sys

import jax.numpy as jnp
import numpy as np

import eqxckpt
from eqxckpt._cli import human_bytes, main


def test_inspect_prints_tree_totals_and_metadata(tmp_path, capsys):
    eqxckpt.save(
        tmp_path / "c",
        {"model": {"w": np.zeros((1024, 256), np.float32), "b": jnp.ones(3)}, "step": 3},
        metadata={"run": "abc"},
    )
    assert main(["inspect", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "model" in out and "w  float32[1024,256]  1.0 MiB" in out and "b  float32[3]  12 B" in out
    assert "step  int = 3" in out
    assert "3 leaves, 2 arrays, 1.0 MiB of array data" in out
    assert '"run": "abc"' in out
    assert main(["inspect", str(tmp_path / "c"), "--at", "model/b"]) == 0
    out = capsys.readouterr().out
    assert "model/b" in out and "1 leaves" in out and "w " not in out


def test_inspect_bad_path_exits_nonzero_with_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "eqxckpt", "inspect", str(tmp_path / "missing")], capture_output=True, text=True
    )
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "does not exist" in result.stderr
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "x").write_text("")
    result = subprocess.run(
        [sys.executable, "-m", "eqxckpt", "inspect", str(tmp_path / "half")], capture_output=True, text=True
    )
    assert result.returncode == 1 and "never committed" in result.stderr


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 1023, 1536, 3 * 2**30)] == ["0 B", "1023 B", "1.5 KiB", "3.0 GiB"]
