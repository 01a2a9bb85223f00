"""The two commands a newcomer runs say what they do before the long install."""

import os
import pathlib
import subprocess

import pytest
from conftest import pyright_path

ROOT = pathlib.Path(__file__).parent.parent


def built_wheel(tmp_path: pathlib.Path, hook: str) -> tuple[pathlib.Path, pathlib.Path]:
    """setuptools' build ``hook`` (``build_wheel(%r)``, with the output directory) run on a
    copy of the project in ``tmp_path``, so that nothing is written into the checkout:
    the copy and the wheel built from it."""
    import shutil
    import sys

    project = tmp_path / "clone"
    project.mkdir()
    shutil.copy(ROOT / "pyproject.toml", project)
    shutil.copy(ROOT / "README.md", project)
    shutil.copytree(ROOT / "eqxckpt", project / "eqxckpt", ignore=shutil.ignore_patterns("__pycache__"))
    build = f"from setuptools import build_meta as b; print(b.{hook % str(tmp_path)})"
    subprocess.run([sys.executable, "-c", build], cwd=project, capture_output=True, check=True, timeout=120)
    [wheel] = tmp_path.glob("*.whl")
    return project, wheel


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
def test_make_docs_installs_only_what_the_site_needs():
    """#55: make docs installed the whole 2.8 GB test environment (TensorFlow, the test
    servers) to build a site that needs mkdocs."""
    plan = subprocess.run(
        ["make", "-n", "-B", "docs"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    ).stdout
    installs = [line for line in plan.splitlines() if "pip install" in line]
    assert len(installs) == 1 and installs[0].endswith('-e ".[docs]"'), installs
    assert "mkdocs build --strict" in plan and "what the docs site needs" in plan


@pytest.mark.multiprocess
def test_the_repository_tracks_no_stray_output():
    """Nothing a run writes is committed: a benchmark's Orbax probe once left a directory named 's3:'."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    if listed.returncode != 0:  # not a git checkout (an unpacked archive): nothing to check
        return
    top = {path.split("/")[0] for path in listed.stdout.splitlines()}
    expected = {".ci", ".gitignore", "Makefile", "README.md", "benchmarks", "docs", "eqxckpt", "examples"}
    assert top <= expected | {"mkdocs.yml", "pyproject.toml", "tests"}, sorted(top - expected)


@pytest.mark.multiprocess
def test_type_checkers_see_the_editable_install_from_outside_the_clone(tmp_path):
    """The Makefile's editable install, as setuptools builds it, is a plain path in a .pth,
    which pyright follows: from a directory outside the clone it resolves eqxckpt and its
    signatures (setuptools' default, an import hook, leaves every type Unknown)."""
    import re
    import sys
    import zipfile

    pyright = pyright_path()
    assert "--config-settings editable_mode=compat -e" in (ROOT / "Makefile").read_text()
    project, wheel = built_wheel(tmp_path, "build_editable(%r, {'editable_mode': 'compat'})")
    with zipfile.ZipFile(wheel) as archive:
        [pth] = [name for name in archive.namelist() if name.endswith(".pth")]
        assert archive.read(pth).decode().strip() == str(project)  # a path, not an import hook
        metadata = archive.read("eqxckpt-0.1.0.dist-info/METADATA").decode()
        assert "Author-email: The eqxckpt maintainers" in metadata  # what `pip show eqxckpt` prints
        # The environment the wheel goes into: a bare venv holding that .pth.
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", tmp_path / "venv"], check=True, timeout=60)
        python = tmp_path / "venv" / "bin" / "python"
        purelib = subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
        pathlib.Path(purelib, pth).write_bytes(archive.read(pth))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "use.py").write_text("import eqxckpt\n\nreveal_type(eqxckpt.load)\nreveal_type(eqxckpt.open)\n")
    checked = subprocess.run(
        [pyright, "--pythonpath", str(python), "use.py"], cwd=elsewhere, capture_output=True, text=True, timeout=120
    )
    assert checked.returncode == 0 and "could not be resolved" not in checked.stdout, checked.stdout
    load_type = re.search(r'Type of "eqxckpt.load" is "(Overload\[)?\(path: str \| PathLike\[str\]', checked.stdout)
    assert load_type, checked.stdout  # its signature (overloaded on `like`), not Unknown
    assert 'Type of "eqxckpt.open" is "(path: ' in checked.stdout and "-> Source" in checked.stdout, checked.stdout


@pytest.mark.multiprocess
def test_a_built_wheel_holds_every_module_and_imports_outside_the_clone(tmp_path):
    """A wheel (what `pip install eqxckpt` gets, not the editable install the suite runs
    against) holds every module of the source tree: pyproject.toml once listed three
    packages by hand and left the wings (_read, _write, _run, ...) out of it."""
    import sys
    import zipfile

    _, wheel = built_wheel(tmp_path, "build_wheel(%r)")
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
        archive.extractall(tmp_path / "site")
    sources = {str(p.relative_to(ROOT)) for p in (ROOT / "eqxckpt").rglob("*.py")} | {"eqxckpt/py.typed"}
    assert sources <= shipped, sorted(sources - shipped)
    # Imported from the unpacked wheel alone, every wing loads and a save round-trips.
    script = (
        "import pkgutil, importlib, numpy as np, eqxckpt, sys\n"
        "assert eqxckpt.__file__.startswith(sys.argv[1]), eqxckpt.__file__\n"
        "[importlib.import_module(m.name) for m in pkgutil.walk_packages(eqxckpt.__path__, 'eqxckpt.')"
        " if not m.name.endswith('__main__')]\n"
        "eqxckpt.save(sys.argv[2], {'w': np.arange(3)})\n"
        "print(eqxckpt.load(sys.argv[2])['w'].tolist())\n"
    )
    site = str(tmp_path / "site")
    done = subprocess.run(
        [sys.executable, "-c", script, site, str(tmp_path / "c")],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": site, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "[0, 1, 2]", done.stderr[-2000:]


def test_the_readme_and_the_makefile_state_the_same_measured_times_and_sizes():
    """The install times and sizes are measured ones (#42: the stated 13 minutes and 2 GB
    were 29 minutes and 2.7 GB when measured), and both files give the same."""
    import re

    readme = " ".join((ROOT / "README.md").read_text().split("## Five minutes", 1)[0].split())
    makefile = " ".join(
        line.lstrip("# ") for line in (ROOT / "Makefile").read_text().split("PYTHON ?=", 1)[0].splitlines()
    )
    for figure in ("28 min 51 s", "24 min 51 s", "713 MB", "2.8 GB", "40 s"):
        assert figure in readme and figure in makefile, figure
    assert "26 to 37 s" in readme and "26-37 s" in makefile
    assert not re.search(r"about (4|13) minutes|2\.7 GB|45 s", readme + makefile)  # the figures before measuring
