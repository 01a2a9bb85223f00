import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_cli

import eqxckpt
from eqxckpt._cli import human_bytes, main
from eqxckpt._paths import PACKED_LOCATION

TINY = pathlib.Path(__file__).parent / "fixtures" / "t5_v1_1_tiny"


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


@pytest.mark.multiprocess
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


LONG = "a_rather_long_parameter_name_" * 6


@pytest.mark.multiprocess
def test_piped_output_is_never_wrapped_and_a_terminal_gets_rich_layout(tmp_path):
    eqxckpt.save(tmp_path / "c", {"model": {LONG: np.zeros(3, np.float32)}})
    status, out, _ = run_cli("inspect", str(tmp_path / "c"))
    assert status == 0 and any(line.endswith(f"{LONG}  float32[3]  12 B") for line in out.splitlines()), out
    status, out, _ = run_cli("inspect", str(tmp_path / "c"), terminal=True)
    assert status == 0 and "\x1b[" in out  # colours and a terminal-width tree
    assert max(len(line) for line in out.replace("\x1b", "").splitlines()) < 200


@pytest.mark.multiprocess
def test_errors_are_printed_whole(tmp_path):
    (tmp_path / "run").mkdir()
    for step in (10, 20):
        eqxckpt.save(tmp_path / "run" / str(step), {"x": np.zeros(2)})
    status, out, err = run_cli("inspect", str(tmp_path / "run"))
    assert status == 1 and out == ""
    assert "is not a checkpoint but a directory of 2 checkpoints (a CheckpointManager run): 10, 20" in err
    assert err.rstrip().endswith("for the latest step.")


@pytest.mark.multiprocess
def test_verify_of_a_missing_path_says_not_found(tmp_path):
    status, out, err = run_cli("verify", str(tmp_path / "nothing"))
    assert status == 1 and "DAMAGED" not in out + err
    assert "No checkpoint at" in err and "does not exist" in err


@pytest.mark.multiprocess
def test_inspect_at_typo_lists_the_top_level(tmp_path):
    eqxckpt.save(tmp_path / "c", {"model": {"w": np.zeros(2)}, "opt_state": {"m": np.zeros(2)}})
    status, _, err = run_cli("inspect", str(tmp_path / "c"), "--at", "modle")
    assert status == 1 and "Nothing under at='modle'" in err and "Its top-level entries are: model, opt_state" in err


@pytest.mark.multiprocess
def test_inspect_names_functions_and_classes_readably(tmp_path):
    import equinox as eqx
    import jax

    eqxckpt.save(tmp_path / "c", {"activation": jax.nn.relu, "layer": eqx.nn.Linear, "f": len})
    status, out, _ = run_cli("inspect", str(tmp_path / "c"))
    assert status == 0
    assert "activation  <function jax._src.nn.functions.relu>" in out
    assert "layer  <class equinox.nn._linear.Linear>" in out and "f  <function builtins.len>" in out
    assert "custom_jvp" not in out


@pytest.mark.multiprocess
def test_import_t5_overwrite_has_help():
    status, out, _ = run_cli("import-t5", "--help")
    assert status == 0 and "replace a checkpoint already at OUT" in " ".join(out.split())


def test_convert_writes_only_the_formats_it_offers(tmp_path, capsys):
    eqxckpt.save(tmp_path / "src", {"w": np.ones(3, np.float32)})
    for unwritable in ("orbax", "tf"):
        try:
            main(["convert", str(tmp_path / "src"), str(tmp_path / unwritable), "--to", unwritable])
            raise AssertionError("argparse accepted an unwritable format")
        except SystemExit as e:
            assert e.code == 2
        assert "invalid choice" in capsys.readouterr().err
        assert not (tmp_path / unwritable).exists()


def test_convert_to_safetensors_writes_the_arrays_and_names_what_it_leaves_out_in_one_line(tmp_path, capsys):
    """A safetensors file can only hold arrays: an Equinox model's other leaves (a step, a
    name, an activation) are left out and named in one line (it refused before, asking
    for --arrays-only, which every Equinox model needed)."""
    import equinox as eqx
    import jax
    import safetensors.numpy as stn

    model = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
    eqxckpt.save(tmp_path / "src", {"model": model, "step": 5, "name": "run", "none": None})
    dst = tmp_path / "out.safetensors"
    assert main(["convert", str(tmp_path / "src"), str(dst)]) == 0  # the format from DST's extension
    out, err = capsys.readouterr()
    [line] = [line for line in err.splitlines() if line.startswith("left out")]
    assert line.startswith("left out 4 leaves that are not arrays: ") and "step (int = 5)" in line, line
    assert (
        "name (str = 'run')" in line and "model/activation (<function" in line and "model/final_activation" in line
    ), line
    assert "(safetensors): 4 leaves" in out
    assert sorted(stn.load_file(str(dst))) == [
        "model.layers.0.bias", "model.layers.0.weight", "model.layers.1.bias", "model.layers.1.weight"
    ]  # fmt: skip
    assert np.array_equal(stn.load_file(str(dst))["model.layers.1.weight"], np.asarray(model.layers[1].weight))


def test_convert_takes_the_format_from_the_destination_and_refuses_a_guess(tmp_path, capsys):
    eqxckpt.save(tmp_path / "src", {"w": np.arange(3, dtype=np.float32)})
    # No extension: an eqxckpt directory. An explicit --to wins over the name.
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "copy")]) == 0
    assert eqxckpt.load(tmp_path / "copy")["w"].tolist() == [0.0, 1.0, 2.0]
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "as-dir.safetensors"), "--to", "eqxckpt"]) == 0
    assert (tmp_path / "as-dir.safetensors" / "eqxckpt.json").is_file()
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "UPPER.SafeTensors")]) == 0
    assert (tmp_path / "UPPER.SafeTensors").is_file()
    capsys.readouterr()
    # The extension of a format eqxckpt does not write: refused, nothing written.
    for name in ("model.pt", "weights.npz", "flax.msgpack", "m.bin"):
        assert main(["convert", str(tmp_path / "src"), str(tmp_path / name)]) == 1
        err = " ".join(capsys.readouterr().err.split())
        assert f"Cannot tell what to write at {tmp_path / name}" in err and "--to safetensors" in err, err
        assert not (tmp_path / name).exists()
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "model.pt"), "--to", "safetensors"]) == 0
    # The outside attack: a bucket URL ending in .safetensors became local directories named
    # after it ("s3:/bucket/..."), reported as written to the bucket. Refused, nothing written.
    capsys.readouterr()
    for url in ("s3://bucket/model.safetensors", "gs://bucket/m.safetensors", "memory://m.safetensors"):
        for extra in ([], ["--to", "safetensors"]):
            assert main(["convert", str(tmp_path / "src"), url, *extra]) == 1
            assert "to a local path only" in " ".join(capsys.readouterr().err.split())
    assert not any(p.name.endswith(":") for p in tmp_path.iterdir()) and not pathlib.Path("s3:").exists()
    # --arrays-only, what every conversion to safetensors now does, is still accepted.
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "b.safetensors"), "--arrays-only"]) == 0


def test_convert_refuses_a_destination_inside_the_source_or_around_it(tmp_path, capsys):
    eqxckpt.save(tmp_path / "src", {"w": np.ones(3, np.float32)})
    for dst in (tmp_path / "src" / "sub", tmp_path / "src", tmp_path):
        assert main(["convert", str(tmp_path / "src"), str(dst), "--overwrite"]) == 1
        assert "one is inside the other" in capsys.readouterr().err
    assert eqxckpt.verify(tmp_path / "src").ok
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == ["eqxckpt.json", "w", "zarr.json"]


def test_help_names_every_command_and_version_prints(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"eqxckpt {eqxckpt.__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "Inspect, verify and convert" in out
    for command in ("inspect", "verify", "convert", "import-t5"):
        assert f"    {command}" in out


def test_errors_name_the_flag_not_the_python_argument(tmp_path, capsys):
    eqxckpt.save(tmp_path / "c", {"w": np.ones(2)})
    eqxckpt.save(tmp_path / "d", {"w": np.ones(2)})
    assert main(["convert", str(tmp_path / "c"), str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err
    assert "Pass --overwrite to replace it" in err and "overwrite=True" not in err


def test_verify_of_a_damaged_packed_chunk_is_one_short_line_per_damaged_leaf(tmp_path, capsys):
    tree = {f"small{i}": np.arange(10.0) + i for i in range(40)} | {"big": np.ones((300, 300))}
    eqxckpt.save(tmp_path / "c", tree)
    chunk = tmp_path / "c" / PACKED_LOCATION / "c" / "0"
    damaged = bytearray(chunk.read_bytes())
    damaged[100] ^= 1
    chunk.write_bytes(bytes(damaged))
    assert main(["verify", str(tmp_path / "c")]) == 1
    lines = capsys.readouterr().out.splitlines()
    leaf_lines = [line for line in lines if line.startswith("small")]
    assert len(leaf_lines) == 40 and all(len(line) < 140 for line in leaf_lines)
    assert sum("fails its CRC-32C checksum" in line for line in lines) == 1  # the chunk's reason, once
    assert all(len(line) < 140 for line in lines[:-1])  # the chunk's line too: details on a line of their own
    assert lines[-3].startswith(f"{PACKED_LOCATION}/c/0: a damaged chunk of the packed array")
    assert lines[-1] == f"DAMAGED {tmp_path / 'c'}: 41 leaves, 1 array intact (703.1 KiB read and checked), 40 problems"
    capsys.readouterr()
    eqxckpt.save(tmp_path / "one", {"w": np.ones(2)})
    assert main(["verify", str(tmp_path / "one")]) == 0
    assert (
        capsys.readouterr().out.splitlines()[-1]
        == f"OK {tmp_path / 'one'}: 1 leaf, 1 array intact (16 B read and checked)"
    )


def test_a_safetensors_file_is_recognised_by_its_content(tmp_path, capsys):
    eqxckpt.save(tmp_path / "c", {"w": np.arange(6.0).reshape(2, 3)})
    assert main(["convert", str(tmp_path / "c"), str(tmp_path / "weights"), "--to", "safetensors"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "weights")]) == 0  # no extension, no --format
    assert "w  float64[2,3]" in capsys.readouterr().out
    (tmp_path / "notes").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json, too short")
    assert main(["inspect", str(tmp_path / "notes")]) == 1  # a file that only starts alike is not taken for one


@pytest.mark.multiprocess
@pytest.mark.tf
def test_import_t5_prints_no_tensorflow_log_lines(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "eqxckpt", "import-t5", str(TINY), str(tmp_path / "t5")],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith("TF_")} | {"JAX_PLATFORMS": "cpu"},
    )
    assert done.returncode == 0, done.stderr
    noise = [line for line in done.stderr.splitlines() if "oneDNN" in line or line[:1] in "IWE" and line[1:5].isdigit()]
    assert not noise and "wrote" in done.stdout


def test_verify_of_a_run_directory_tells_a_shared_damaged_file_once(tmp_path, capsys):
    """``eqxckpt verify run/`` verifies every step; a damaged file that incremental steps
    share is told once, naming every step that holds it, not once per step."""
    run = tmp_path / "run"
    with eqxckpt.CheckpointManager(run, blocking=True, kept_copies=1) as manager:
        for step in range(3):
            manager.save(step, {"frozen": np.arange(50_000, dtype=np.float32), "step": np.full(70_000, step)})
    assert main(["verify", str(run)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"OK {run}: 3 checkpoints, all intact, ")
    damaged = bytearray((run / "2/frozen/c/0").read_bytes())
    damaged[0] ^= 1
    (run / "2/frozen/c/0").write_bytes(bytes(damaged))
    (run / "2/step/c/0").write_bytes(b"")  # a leaf of step 2 alone
    assert main(["verify", str(run)]) == 1
    lines = capsys.readouterr().out.splitlines()
    told = [line for line in lines if "/frozen: " in line]
    assert len(told) == 1 and told[0].startswith("0/frozen: ") and "fails its CRC-32C checksum" in told[0]
    assert lines[lines.index(told[0]) + 1].strip().startswith("the same stored files are in 1, 2 beside it")
    assert [line.split(":")[0] for line in lines if "/step: " in line] == ["2/step"]
    assert lines[-1].startswith(f"DAMAGED {run}: 3 checkpoints, 3 damaged (0, 1, 2), ")


# What the command imports, printed by the command's own process after it has run.
_MODULES_AFTER = """
import runpy, sys
sys.argv = ["eqxckpt", *sys.argv[1:]]
try:
    runpy.run_module("eqxckpt", run_name="__main__")
except SystemExit:
    pass
print(" ".join(sorted(m for m in ("jax", "jaxlib", "equinox", "jaxtyping", "numpy") if m in sys.modules)), file=sys.stderr)
"""


@pytest.mark.parametrize("command", [["--help"], ["inspect", "CHECKPOINT"]])
def test_help_and_inspect_start_without_jax(tmp_path, command):
    # JAX's import is most of a second of CPU: a command that only reads files never pays it.
    eqxckpt.save(tmp_path / "c", {"w": np.ones(3, np.float32), "key": jax.random.key(0), "step": 1})
    argv = [str(tmp_path / "c") if arg == "CHECKPOINT" else arg for arg in command]
    done = subprocess.run([sys.executable, "-c", _MODULES_AFTER, *argv], capture_output=True, text=True, timeout=60)
    *_, imported = done.stderr.splitlines()
    assert ("usage: eqxckpt" if command == ["--help"] else "3 leaves, 2 arrays") in done.stdout, done.stdout
    assert "jax" not in imported.split() and "equinox" not in imported.split(), imported
    if command == ["--help"]:
        assert imported == "", imported  # not even numpy


def test_the_package_face_imports_its_heavy_parts_on_first_use():
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, eqxckpt; a = 'jax' in sys.modules; eqxckpt.save; print(a, 'jax' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.split() == ["False", "True"], done.stderr
    public = {name for name in dir(eqxckpt) if not name.startswith("_")}
    assert {"load", "save", "CheckpointManager", "open", "CheckpointError"} <= public
    assert not public & {"TYPE_CHECKING", "Any", "importlib"}  # the API only (the docs list every public name)
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        eqxckpt.nonexistent  # noqa: B018


def test_star_import_gives_the_api_as_before_the_lazy_package_face():
    # b0b80a8: `from eqxckpt import *` bound save, load, ...; the lazy face binds only the errors.
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from eqxckpt import *\nprint(sorted({'save', 'load', 'open', 'CheckpointManager'} - set(dir())))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_first_use_of_the_package_face_from_two_threads_at_once():
    # Two threads touching eqxckpt.save and eqxckpt.load for the first time: both must get them
    # (b0b80a8 imported everything in `import eqxckpt`, so this could not fail).
    script = (
        "import threading, eqxckpt\n"
        "errors, barrier = [], threading.Barrier(2)\n"
        "def use(name):\n"
        "    barrier.wait()\n"
        "    try:\n"
        "        getattr(eqxckpt, name)\n"
        "    except Exception as e:\n"
        "        errors.append(repr(e))\n"
        "threads = [threading.Thread(target=use, args=(n,)) for n in ('save', 'load')]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]\n"
        "print(errors)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


def test_the_package_lists_every_public_name_once_and_each_resolves():
    """`__all__` (what a star import binds) is the API `dir()` shows, each name importable."""
    public = {name for name in dir(eqxckpt) if not name.startswith("_")}
    assert set(eqxckpt.__all__) == public | {"__version__"}
    assert len(eqxckpt.__all__) == len(set(eqxckpt.__all__))
    assert all(getattr(eqxckpt, name) is not None for name in eqxckpt.__all__)


def naming(path: str) -> str:
    """A --names function for the test below (imported by the command line as test_cli:naming)."""
    return "model." + path.replace("/", ".")


def test_convert_streams_any_source_into_huggingfaces_shards(tmp_path, capsys, monkeypatch):
    """``--max-shard-size``: an eqxckpt checkpoint (and a safetensors file) into a sharded
    directory, each shard what the library writes, the index what the hub splits;
    ``--names MODULE:FUNC`` names the tensors."""
    import json

    import safetensors.numpy as stn
    from huggingface_hub import split_state_dict_into_shards_factory

    rng = np.random.default_rng(0)
    tree = {"blocks": [{"w": rng.standard_normal((64, 32)).astype(np.float32)} for _ in range(4)], "step": 3}
    eqxckpt.save(tmp_path / "ckpt", tree)
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))
    out = tmp_path / "hf"
    args = ["convert", str(tmp_path / "ckpt"), str(out), "--max-shard-size", "20KB", "--names", "test_cli:naming"]
    assert main(args) == 0
    tensors = {f"model.blocks.{i}.w": tree["blocks"][i]["w"] for i in range(4)}
    plan = split_state_dict_into_shards_factory(
        tensors,
        get_storage_size=lambda t: t.nbytes,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=20_000,
    )
    assert sorted(p.name for p in out.iterdir()) == sorted([*plan.filename_to_tensors, "model.safetensors.index.json"])
    for name, names in plan.filename_to_tensors.items():
        assert (out / name).read_bytes() == stn.save({n: tensors[n] for n in names})
    assert json.loads((out / "model.safetensors.index.json").read_text())["weight_map"] == plan.tensor_to_filename
    assert "left out 1 leaves that are not arrays: step" in capsys.readouterr().err
    # From those shards, into other shards (a number of bytes), and refusals.
    assert main(["convert", str(out), str(tmp_path / "again"), "--max-shard-size", "9000"]) == 0
    assert len(list((tmp_path / "again").iterdir())) == 5  # four shards and the index
    assert main(["convert", str(out), str(tmp_path / "x"), "--max-shard-size", "1KB", "--to", "eqxckpt"]) == 1
    assert main(["convert", str(out), str(tmp_path / "y"), "--max-shard-size", "5GiB"]) == 1
    assert main(["convert", str(out), str(tmp_path / "z"), "--max-shard-size", "1KB", "--names", "nowhere:f"]) == 1
    assert not any((tmp_path / name).exists() for name in ("x", "y", "z"))
