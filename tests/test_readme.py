"""The README's examples are part of the test suite: they must run as written."""

import pathlib
import re

import pytest
from conftest import untracked

README = pathlib.Path(__file__).parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_examples_run_twice_from_another_directory(tmp_path, monkeypatch, capsys, s3):
    """The examples run as written, in order, from a directory outside the repository;
    run again, they work on what the first run left; nothing is written into the repository."""
    before = untracked()
    monkeypatch.chdir(tmp_path)
    endpoint, client = s3
    client.create_bucket(Bucket="my-bucket")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)  # the README's s3:// example goes to moto
    blocks = python_blocks()
    assert len(blocks) >= 5
    for run in range(2):
        namespace: dict = {}
        for block in blocks:
            exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - our own README
        if run == 0:
            check_first_run(tmp_path, capsys.readouterr().out, client)
    assert untracked() == before


def check_first_run(tmp_path, out: str, client) -> None:
    assert "missing from the checkpoint" in out and "(32, 2) float32 256" in out
    assert (tmp_path / "ckpt/step_10/eqxckpt.json").exists()
    assert (tmp_path / "ckpt/step_20/eqxckpt.json").exists()
    assert "(2, 3, 512)" in out and (tmp_path / "t5_eqx/eqxckpt.json").exists()
    assert "(4, 9) (4,)" in out
    losses = dict(re.findall(r"\[(\d, \d)\] loss (\S+)", out))  # steps kept, loss at the end of each run
    assert float(losses["4, 5"]) < float(losses["1, 2"])  # fine-tuning went on from where it stopped
    assert sorted(p.name for p in (tmp_path / "my-t5").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert "[0, 10, 15, 20] best: 20" in out and sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "0",
        "10",
        "15",
        "20",
    ]
    assert "NamedSharding" in out and "['model/layers/0/weight', 'model/layers/0/bias']" in out
    assert client.get_object(Bucket="my-bucket", Key="run/step_20/eqxckpt.json")["ContentLength"] > 0


def readme_runner():
    """`examples/readme.py`, the runner `make demo` uses, as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("readme_runner", README.parent / "examples" / "readme.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_demo_runs_every_block_that_needs_no_tensorflow(monkeypatch):
    """`make demo` runs the README's examples; without TensorFlow it skips only the
    blocks that say they need it, and the object-store one when no server is set."""
    runner = readme_runner()
    assert [code for _, code in runner.blocks()] == python_blocks()
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setattr(runner.importlib.util, "find_spec", lambda name: None)  # as if nothing optional is there
    skipped = [code for _, code in runner.blocks() if runner.why_not(code)]
    assert len(skipped) == 2
    assert all(code.startswith("# Needs TensorFlow") or code.startswith("# Needs an S3 server") for code in skipped)
    for code in python_blocks():  # a block that uses TensorFlow says so on its first line
        uses_tf = any(name in code for name in ("load_tf", "convert_tf", "tensorflow"))
        assert uses_tf == code.startswith("# Needs TensorFlow"), code[:200]
    makefile = (README.parent / "Makefile").read_text()
    assert "$(BIN)/python examples/readme.py" in makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]


def test_the_readme_install_line_brings_what_its_examples_import():
    """`pip install -e '.[examples]'`, as the README says, gives every module its examples
    import (the TensorFlow block adds the `tf` extra, as its first line says)."""
    import ast
    import importlib.metadata
    import sys
    import tomllib

    project = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[<>=!~ \[;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}

    extras = project["optional-dependencies"]
    installed = names(project["dependencies"]) | names(extras["examples"]) | {"eqxckpt"}
    assert "[examples]" in README.read_text().split("## Five minutes with eqxckpt", 1)[1].split("```", 1)[0]
    distributions = importlib.metadata.packages_distributions()
    for code in python_blocks():
        allowed = installed | (names(extras["tf"]) | {"tensorflow"} if code.startswith("# Needs TensorFlow") else set())
        for node in ast.walk(ast.parse(code)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top == "eqxckpt":
                    continue
                provided = {d.lower().replace("_", "-") for d in distributions.get(top, [top])}
                assert provided & allowed, f"the README imports {module}, which the install line does not bring"


@pytest.mark.s3
def test_the_s3_quick_start_runs_as_pasted_from_another_directory(tmp_path):
    """The README's shell lines that start moto and create the bucket, run from a directory
    outside the clone (on a free port, and without the `pip install`, which the test
    environment has done): the bucket exists when they finish, and the README's s3:// save
    goes to it."""
    import os
    import socket
    import subprocess
    import sys

    text = README.read_text()
    [listing] = re.findall(r"```bash\n(pip install 'moto\[server\]'\n.*?)```", text, flags=re.S)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    lines = [line.replace("5000", str(port)) for line in listing.splitlines() if not line.startswith("pip install")]
    save = "import eqxckpt, numpy as np; eqxckpt.save('s3://my-bucket/quick', {'w': np.ones(2)}); print(eqxckpt.load('s3://my-bucket/quick'))"
    script = "\n".join(["trap 'kill $(jobs -p)' EXIT", *lines, f'"{sys.executable}" -c "{save}"'])
    environment = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-e", "-c", script], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "{'w': array([1., 1.])}" in done.stdout, done.stdout
