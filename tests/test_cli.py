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


def test_convert_between_safetensors_and_eqxckpt_round_trips_bit_exact(tmp_path, capsys):
    import ml_dtypes
    import safetensors.numpy as stn

    tensors = {
        "model.layers.0.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "model.embedding": np.arange(8, dtype=np.float32).astype(ml_dtypes.bfloat16),
        "model.positions": np.arange(5, dtype=np.int64),
    }
    stn.save_file(tensors, str(tmp_path / "hf.safetensors"), metadata={"origin": "hub"})
    assert main(["convert", str(tmp_path / "hf.safetensors"), str(tmp_path / "eqx")]) == 0
    assert "wrote" in capsys.readouterr().out
    ckpt = eqxckpt.open(tmp_path / "eqx")
    assert ckpt.metadata == {"origin": "hub"} and ckpt.leaf("model/embedding").describe() == "bfloat16[8]"
    assert main(["inspect", str(tmp_path / "hf.safetensors")]) == 0
    assert "positions  int64[5]" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "eqx"), str(tmp_path / "back.safetensors"), "--to", "safetensors"]) == 0
    back = stn.load_file(str(tmp_path / "back.safetensors"))
    assert sorted(back) == sorted(tensors)
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and back[name].tobytes() == value.tobytes()
    # Nothing is replaced without --overwrite.
    assert main(["convert", str(tmp_path / "eqx"), str(tmp_path / "back.safetensors"), "--to", "safetensors"]) == 1
    assert main(["convert", str(tmp_path / "hf.safetensors"), str(tmp_path / "eqx")]) == 1
