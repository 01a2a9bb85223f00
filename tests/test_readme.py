"""The README's examples are part of the test suite: they must run as written."""

import pathlib
import re
import shutil

README = pathlib.Path(__file__).parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_examples_run_in_order(tmp_path, monkeypatch, capsys, s3):
    monkeypatch.chdir(tmp_path)
    endpoint, client = s3
    client.create_bucket(Bucket="my-bucket")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)  # the README's s3:// example goes to moto
    shutil.copytree(README.parent / "tests" / "fixtures" / "t5_v1_1_tiny", tmp_path / "t5_v1_1_tiny")
    blocks = python_blocks()
    assert len(blocks) >= 5
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102 - our own README
    out = capsys.readouterr().out
    assert "missing from the checkpoint" in out and "(32, 2) float32 256" in out
    assert (tmp_path / "ckpt/step_10/eqxckpt.json").exists()
    assert (tmp_path / "ckpt/step_20/eqxckpt.json").exists()
    assert "(2, 3, 512)" in out and (tmp_path / "t5_eqx/eqxckpt.json").exists()
    assert "(4, 9) (4,)" in out
    assert "`t5_v1_1_tiny` below is the tiny test model in\n`tests/fixtures/t5_v1_1_tiny`" in README.read_text()
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
