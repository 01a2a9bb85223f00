"""The two commands a newcomer runs say what they do before the long install."""

import pathlib
import subprocess

ROOT = pathlib.Path(__file__).parent.parent


def test_make_demo_says_what_it_installs():
    plan = subprocess.run(
        ["make", "-n", "-B", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    lines = plan.splitlines()
    install = next(i for i, line in enumerate(lines) if "pip install" in line)
    said = " ".join(lines[:install])
    assert "echo" in said and "Creating the virtual environment" in said
    assert "Installing eqxckpt" in said and "about 2 minutes" in said
