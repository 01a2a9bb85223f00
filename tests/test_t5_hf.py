"""HuggingFace's T5 layout: `load_hf` of the files transformers wrote
(tests/fixtures/t5_v1_1_tiny/hf and hf_bf16, copied from ../shared/t5), `save_hf`."""

import dataclasses
import json
import pathlib
import shutil
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy as stn
from conftest import assert_trees_equal

import eqxckpt
from eqxckpt import t5

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "t5_v1_1_tiny"
REF = np.load(FIXTURE / "reference.npz")


@eqx.filter_jit  # compiled whole: run eagerly, each operation under vmap is compiled alone
def batch_logits(model, ids, decoder_ids, mask):
    return jax.vmap(lambda i, d, m: model(i, d, attention_mask=m))(ids, decoder_ids, mask)


def logits(model, prefix=""):
    ids, mask = REF[prefix + "input_ids"], REF[prefix + "attention_mask"]
    return np.asarray(batch_logits(model, ids, REF[prefix + "decoder_input_ids"], mask))


@pytest.fixture(scope="module")
def from_tf():
    return t5.load_tf(FIXTURE)


@pytest.mark.tf
@pytest.mark.parametrize("directory", ["hf", "hf_bf16"])
def test_load_hf_gives_the_reference_logits(directory, from_tf):
    model = t5.load_hf(FIXTURE / directory)
    assert model.config == from_tf.config
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(model)} == {jnp.dtype(jnp.float32)}
    for prefix in ("", "short_"):
        np.testing.assert_allclose(logits(model, prefix), REF[prefix + "logits"], atol=2e-5, rtol=0)
    assert_trees_equal(model, from_tf)  # the same weights as the TF checkpoint's, exactly


def test_load_hf_keeps_the_stored_dtype_when_asked():
    model = t5.load_hf(FIXTURE / "hf_bf16", dtype="auto")
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(model)} == {jnp.dtype(jnp.bfloat16)}


def test_load_hf_reads_each_tensor_once_and_only_what_the_model_needs(tmp_path, monkeypatch):
    from eqxckpt._formats._safetensors import _read as _safetensors

    reads = []
    original = _safetensors.read_range
    monkeypatch.setattr(
        _safetensors,
        "read_range",
        lambda fd, offset, buffer, path: (reads.append(path), original(fd, offset, buffer, path)),
    )
    t5.load_hf(FIXTURE / "hf")
    assert len(reads) == len(set(reads)) == 52


@pytest.mark.parametrize("directory", ["hf", "hf_bf16"])
def test_save_hf_writes_huggingfaces_layout_and_round_trips_exactly(tmp_path, directory):
    model = t5.load_hf(FIXTURE / directory, dtype="auto")
    t5.save_hf(tmp_path / "out", model)
    ours, theirs = (
        stn.load_file(str(tmp_path / "out/model.safetensors")),
        stn.load_file(str(FIXTURE / directory / "model.safetensors")),
    )
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype and ours[name].shape == theirs[name].shape, name
        np.testing.assert_array_equal(ours[name], theirs[name])  # the same bytes: the model is the file
    with open(tmp_path / "out/model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["__metadata__"] == {"format": "pt"}  # what transformers requires to load it
    config, expected = (
        json.loads(p.read_text()) for p in (tmp_path / "out/config.json", FIXTURE / directory / "config.json")
    )
    assert config == expected
    generation = json.loads((tmp_path / "out/generation_config.json").read_text())
    assert {k: generation[k] for k in ("decoder_start_token_id", "eos_token_id", "pad_token_id")} == {
        "decoder_start_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 0,
    }
    assert_trees_equal(t5.load_hf(tmp_path / "out", dtype="auto"), model)


def test_tied_v10_model_round_trips_without_lm_head(tmp_path):
    config = t5.T5Config(vocab_size=50, d_model=16, d_kv=4, d_ff=24, num_layers=2, num_decoder_layers=1, num_heads=3)
    model = t5.T5(config, key=jax.random.key(7))
    t5.save_hf(tmp_path / "v10", model)
    names = set(stn.load_file(str(tmp_path / "v10/model.safetensors")))
    assert "lm_head.weight" not in names and "encoder.block.0.layer.1.DenseReluDense.wi.weight" in names
    assert json.loads((tmp_path / "v10/config.json").read_text())["feed_forward_proj"] == "relu"
    loaded = t5.load_hf(tmp_path / "v10")
    assert loaded.config == config
    assert_trees_equal(loaded, model)


@pytest.mark.tf
def test_alias_tensors_are_accepted_when_equal_and_refused_when_not(tmp_path, from_tf):
    tensors = stn.load_file(str(FIXTURE / "hf/model.safetensors"))
    directory = tmp_path / "aliases"
    directory.mkdir()
    shutil.copy(FIXTURE / "hf/config.json", directory / "config.json")
    aliases = {
        name: tensors["shared.weight"] for name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
    }
    stn.save_file({**tensors, **aliases}, str(directory / "model.safetensors"), metadata={"format": "pt"})
    assert_trees_equal(t5.load_hf(directory), from_tf)
    aliases["decoder.embed_tokens.weight"] = tensors["shared.weight"] + 1
    stn.save_file({**tensors, **aliases}, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(eqxckpt.CheckpointError, match="decoder.embed_tokens.weight differs from shared.weight"):
        t5.load_hf(directory)


@pytest.mark.tf
def test_sharded_directory_loads(tmp_path, from_tf):
    tensors = stn.load_file(str(FIXTURE / "hf/model.safetensors"))
    directory = tmp_path / "sharded"
    directory.mkdir()
    shutil.copy(FIXTURE / "hf/config.json", directory / "config.json")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:20], "model-00002-of-00002.safetensors": names[20:]}
    for shard, members in shards.items():
        stn.save_file({n: tensors[n] for n in members}, str(directory / shard), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: shard for shard, members in shards.items() for n in members}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_trees_equal(t5.load_hf(directory), from_tf)


def test_misfits_are_named_by_their_huggingface_names(tmp_path):
    tensors = stn.load_file(str(FIXTURE / "hf/model.safetensors"))
    directory = tmp_path / "bad"
    directory.mkdir()
    shutil.copy(FIXTURE / "hf/config.json", directory / "config.json")
    del tensors["decoder.block.1.layer.2.DenseReluDense.wo.weight"]
    tensors["encoder.block.0.layer.0.SelfAttention.q.weight"] = np.zeros((64, 32), np.float32)
    tensors["encoder.block.0.layer.0.SelfAttention.extra.weight"] = np.zeros(3, np.float32)
    stn.save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(eqxckpt.StructureMismatchError) as info:
        t5.load_hf(directory)
    message = str(info.value)
    assert "decoder/blocks/1/feed_forward/wo: expected float32[64,32], named decoder.block.1.layer.2.Dense" in message
    assert "found float32[3], stored as encoder.block.0.layer.0.SelfAttention.extra.weight" in message
    assert (
        "encoder/blocks/0/self_attention/q: expected float32[32,128], found float32[32,64], "
        "stored as encoder.block.0.layer.0.SelfAttention.q.weight (transposed)"
    ) in message
    assert message.endswith("Fix config.json or use the weights it describes.")
    assert [path for path, _ in info.value.mismatched] == ["encoder/blocks/0/self_attention/q"]
    (directory / "config.json").unlink()
    with pytest.raises(eqxckpt.CheckpointNotFoundError, match="no config.json"):
        t5.load_hf(directory)


def test_save_hf_never_replaces_files_without_overwrite(tmp_path):
    model = t5.T5(
        t5.T5Config(vocab_size=20, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2), key=jax.random.key(0)
    )
    t5.save_hf(tmp_path / "m", model)
    before = (tmp_path / "m/model.safetensors").read_bytes()
    other = t5.T5(model.config, key=jax.random.key(1))
    with pytest.raises(eqxckpt.CheckpointExistsError, match="overwrite=True"):
        t5.save_hf(tmp_path / "m", other)
    assert (tmp_path / "m/model.safetensors").read_bytes() == before
    t5.save_hf(tmp_path / "m", other, overwrite=True)
    assert_trees_equal(t5.load_hf(tmp_path / "m"), other)
    per_layer = t5.T5(dataclasses.replace(model.config, relative_attention_per_layer=True), key=jax.random.key(0))
    with pytest.raises(eqxckpt.CheckpointError, match="one per stack"):
        t5.save_hf(tmp_path / "per_layer", per_layer)
    assert not (tmp_path / "per_layer").exists()


@pytest.mark.multiprocess
@pytest.mark.tf
def test_import_t5_command_reads_huggingface_directories(tmp_path, from_tf):
    result = subprocess.run(
        [sys.executable, "-m", "eqxckpt", "import-t5", str(FIXTURE / "hf_bf16"), str(tmp_path / "t5")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "vocab 512" in result.stdout
    config = t5.T5Config(**eqxckpt.open(tmp_path / "t5").metadata["t5_config"])
    assert_trees_equal(
        eqxckpt.load(tmp_path / "t5", lambda: t5.T5(config, key=jax.random.key(0)), at="params"), from_tf
    )


def test_hostile_config_json_is_refused_before_anything_is_built(tmp_path):
    directory = tmp_path / "hostile"
    shutil.copytree(FIXTURE / "hf", directory)
    (directory / "config.json").chmod(0o644)
    config = json.loads((FIXTURE / "hf/config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "num_layers": 10**9}))
    with pytest.raises(eqxckpt.CheckpointError, match="num_layers must be an integer from 1 to 256"):
        t5.load_hf(directory)
    (directory / "config.json").write_text(json.dumps({**config, "num_layers": 3}))
    with pytest.raises(eqxckpt.StructureMismatchError, match="asks for 3 encoder blocks, the weights hold 2"):
        t5.load_hf(directory)
    (directory / "config.json").write_text(json.dumps({**config, "d_model": "32"}))
    with pytest.raises(eqxckpt.CheckpointError, match="d_model must be an integer from 1 to 65536.*got '32'"):
        t5.load_hf(directory)
    for field, value, match in [
        ("layer_norm_epsilon", [1e-6], "layer_norm_epsilon must be a number"),
        ("d_ff", int("9" * 4000), r"d_ff must be an integer from 1 to 262144.*got 9999.*\(4000 chars\)"),
        ("tie_word_embeddings", [True], "must be true or false"),
    ]:
        (directory / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(eqxckpt.CheckpointError, match=match):
            t5.load_hf(directory)
    (directory / "config.json").write_text("[1, 2]")
    with pytest.raises(eqxckpt.CheckpointError, match="not .*object"):
        t5.load_hf(directory)
    (directory / "config.json").write_text(" " * (5 * 1024 * 1024) + "{}")
    with pytest.raises(eqxckpt.CheckpointError, match="too large"):
        t5.load_hf(directory)


def test_many_empty_blocks_are_refused_before_a_skeleton_is_built(tmp_path):
    """A few MB of files whose config.json asks for many (empty) blocks: refused by what
    the files can hold, before any skeleton is built."""
    config = json.loads((FIXTURE / "hf/config.json").read_text())
    for blocks, match in [(20_000, "num_layers must be an integer from 1 to 256"), (256, "at least .* weights")]:
        directory = tmp_path / str(blocks)
        directory.mkdir()
        (directory / "config.json").write_text(
            json.dumps({**config, "num_layers": blocks, "num_decoder_layers": blocks})
        )
        names = [
            f"{stack}.block.{i}.layer.0.SelfAttention.q.weight"
            for stack in ("encoder", "decoder")
            for i in range(blocks)
        ]
        stn.save_file({name: np.zeros(0, np.float32) for name in names}, str(directory / "model.safetensors"))
        with pytest.raises(eqxckpt.CheckpointError, match=match):
            t5.load_hf(directory)


def test_convert_hf_reports_progress_for_the_read_and_the_write(tmp_path):
    seen = []
    t5.convert_hf(FIXTURE / "hf", tmp_path / "out", progress=lambda *counts: seen.append(counts))
    total = eqxckpt.open(tmp_path / "out").nbytes
    finals = [counts for counts in seen if counts[0] == counts[1]]
    assert len(finals) >= 2  # the load's report finished, then the save's
    assert finals[-1][1] == total and finals[-1][2] == finals[-1][3]


def test_save_hf_takes_the_location_first_and_refuses_the_other_order(tmp_path):
    model = t5.load_hf(FIXTURE / "hf")
    t5.save_hf(tmp_path / "new", model)
    assert jnp.array_equal(t5.load_hf(tmp_path / "new").shared, model.shared)
    with pytest.raises(eqxckpt.ArgumentError, match="location comes first"):
        t5.save_hf(model, tmp_path / "old")  # type: ignore[arg-type]
    assert not (tmp_path / "old").exists()
