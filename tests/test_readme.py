"""The README's examples are part of the test suite: they must run as written."""

import pathlib
import re

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
