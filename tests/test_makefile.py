"""The two commands a newcomer runs say what they do before the long install."""

import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).parent.parent


@pytest.mark.multiprocess
def test_make_demo_says_what_it_installs():
    plan = subprocess.run(
        ["make", "-n", "-B", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    lines = plan.splitlines()
    install = next(i for i, line in enumerate(lines) if "pip install" in line)
    said = " ".join(lines[:install])
    assert "echo" in said and "Creating the virtual environment" in said
    assert "Installing eqxckpt" in said and "what the demo needs" in said
    # Only the demo's own dependencies: no TensorFlow, test servers or docs toolchain (2.7 GB before).
    assert '-e ".[demo]"' in lines[install] and "tf" not in lines[install] and "docs" not in lines[install]
    assert "source .venv/bin/activate" in plan  # where the eqxckpt command is, once installed


@pytest.mark.multiprocess
def test_the_repository_tracks_no_stray_output():
    """Nothing a run writes is committed: a benchmark's Orbax probe once left a directory named 's3:'."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    if listed.returncode != 0:  # not a git checkout (an unpacked archive): nothing to check
        return
    top = {path.split("/")[0] for path in listed.stdout.splitlines()}
    expected = {".ci", ".gitignore", "Makefile", "README.md", "benchmarks", "docs", "eqxckpt", "examples"}
    assert top <= expected | {"mkdocs.yml", "pyproject.toml", "tests"}, sorted(top - expected)
