"""A scanned T5 (``scan_layers=True``): each stack's blocks stacked into one block and run
with `jax.lax.scan`. It holds the per-layer T5's weights, gives its outputs, generates
HuggingFace's tokens (tests/fixtures/t5_v1_1_tiny, copied from ../shared/t5) and writes
HuggingFace's per-layer files."""

import dataclasses
import json
import pathlib
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy as stn
from conftest import assert_trees_equal

import eqxckpt
from eqxckpt import t5
from eqxckpt._tree import flatten

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "t5_v1_1_tiny"
REF = np.load(FIXTURE / "reference.npz")
HF = np.load(FIXTURE / "generation.npz")
EOS = 1
# v1.0 (tied, ReLU) with one relative attention table per block and more decoder blocks
# than encoder blocks: every part whose layout differs when stacked.
SMALL = t5.T5Config(
    vocab_size=97,
    d_model=16,
    d_kv=8,
    d_ff=32,
    num_layers=2,
    num_decoder_layers=3,
    num_heads=2,
    relative_attention_per_layer=True,
)


def edited_hf_copy(directory: pathlib.Path, edit) -> pathlib.Path:
    """The reference HuggingFace directory, copied to ``directory`` with ``edit`` applied to its tensors."""
    directory.mkdir()
    shutil.copy(FIXTURE / "hf" / "config.json", directory / "config.json")
    tensors = stn.load_file(str(FIXTURE / "hf" / "model.safetensors"))
    edit(tensors)
    stn.save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


@eqx.filter_jit
def batch_logits(model, ids, decoder_ids, mask):
    return jax.vmap(lambda i, d, m: model(i, d, attention_mask=m))(ids, decoder_ids, mask)


def through_first_eos(row: np.ndarray) -> np.ndarray:
    ends = np.flatnonzero(row == EOS)
    return row[: ends[0] + 1] if len(ends) else row


def paths_and_shapes(model) -> dict[str, tuple[int, ...]]:
    return {path: leaf.shape for path, _, leaf in flatten(model)[0] if isinstance(leaf, jax.Array)}


def test_scanned_t5_stacks_the_per_layer_t5s_blocks():
    per_layer = t5.T5(SMALL, key=jax.random.key(1))
    scanned = t5.T5(SMALL, key=jax.random.key(1), scan_layers=True)
    assert scanned.scan_layers and not per_layer.scan_layers
    assert_trees_equal(t5.scan(per_layer), scanned)  # the same key draws the same weights in either layout
    assert_trees_equal(t5.unscan(scanned), per_layer)
    assert t5.scan(scanned) is scanned and t5.unscan(per_layer) is per_layer
    shapes = paths_and_shapes(scanned)
    # The natural paths, each with a leading layer axis; the rest as in the per-layer T5.
    assert shapes["encoder/blocks/self_attention/q"] == (2, 16, 16)
    assert shapes["decoder/blocks/cross_attention/o"] == (3, 16, 16)
    assert shapes["decoder/blocks/relative_attention_bias"] == (3, 2, 32)
    assert shapes["decoder/final_norm/scale"] == (16,)
    assert not any("blocks/0" in path for path in shapes)
    assert len(shapes) == len({p for p in paths_and_shapes(per_layer) if "blocks/" not in p or "blocks/0/" in p})


def test_scanned_forward_and_cached_decoding_give_the_per_layer_outputs():
    per_layer = t5.T5(SMALL, key=jax.random.key(1))
    scanned = t5.scan(per_layer)
    ids = jax.random.randint(jax.random.key(2), (3, 9), 2, SMALL.vocab_size)
    mask = jnp.arange(9)[None, :] < jnp.array([[9], [5], [2]])
    decoder_ids = jax.random.randint(jax.random.key(3), (3, 6), 2, SMALL.vocab_size)
    forward = batch_logits
    expected = np.asarray(forward(per_layer, ids, decoder_ids, mask))
    np.testing.assert_allclose(forward(scanned, ids, decoder_ids, mask), expected, atol=1e-5)

    # The cache is stacked over the blocks, each row's [layers, ...]: generate broadcasts
    # it over rows and reorders them as it does a per-layer cache.
    memory = jax.vmap(lambda i, m: scanned.encode(i, attention_mask=m))(ids, mask)
    cache = jax.tree.map(lambda x: jnp.broadcast_to(x, (3, *x.shape)), scanned.init_cache(6))
    cross = jax.vmap(scanned.cross_cache)(memory)
    assert jax.tree.map(jnp.shape, cache) == ((3, 3, 2, 8, 6), (3, 3, 2, 6, 8))
    assert jax.tree.map(jnp.shape, cross) == ((3, 3, 2, 8, 9), (3, 3, 2, 9, 8))
    # One position at a time, the scanned cache gives the teacher-forced per-layer logits.
    step = eqx.filter_jit(lambda model, *args: model.decode_step(*args))
    for position in range(6):
        logits, cache = step(scanned, decoder_ids[:, position], jnp.int32(position), cache, cross, mask)
        np.testing.assert_allclose(logits, expected[:, position], atol=1e-5)
    per_layer_cross = jax.vmap(per_layer.cross_cache)(memory)
    np.testing.assert_allclose(cross[1], np.stack([v for _, v in per_layer_cross], axis=1), atol=1e-6)


@pytest.fixture(scope="module")
def scanned_hf():
    return t5.load_hf(FIXTURE / "hf", scan_layers=True)


@pytest.mark.tf
def test_scanned_load_tf_and_load_hf_hold_the_same_weights_and_give_the_reference_logits(scanned_hf):
    scanned_tf = t5.load_tf(FIXTURE, scan_layers=True)
    assert scanned_tf.scan_layers and scanned_tf.config == scanned_hf.config
    assert_trees_equal(scanned_tf, scanned_hf)
    assert_trees_equal(t5.unscan(scanned_hf), t5.load_hf(FIXTURE / "hf"))  # the per-layer import, stacked exactly
    short = (REF[f"short_{name}"] for name in ("input_ids", "decoder_input_ids", "attention_mask"))
    np.testing.assert_allclose(batch_logits(scanned_hf, *short), REF["short_logits"], atol=2e-5, rtol=0)


def test_scanned_load_hf_generates_huggingfaces_greedy_tokens(scanned_hf):
    # eos_mix: rows emit EOS at steps 10, 24, 41 and 64, two never do.
    out = t5.generate(scanned_hf, HF["eos_mix_input_ids"], HF["eos_mix_attention_mask"], max_new_tokens=64)
    np.testing.assert_array_equal(np.asarray(out.sequences), HF["greedy_eos_mix_sequences"])
    unfinished = ~HF["greedy_eos_mix_finished"]
    assert out.scores is not None
    np.testing.assert_allclose(np.asarray(out.scores)[unfinished], HF["greedy_eos_mix_scores"][unfinished], atol=1e-5)


def test_scanned_load_hf_generates_huggingfaces_beams(scanned_hf):
    # beam_eos: returned beams that end in EOS at steps 9, 42, 30 and 61, the rest run to 64.
    out = t5.generate(
        scanned_hf,
        HF["beam_eos_input_ids"],
        HF["beam_eos_attention_mask"],
        max_new_tokens=64,
        num_beams=4,
        num_return_sequences=4,
    )
    expected = HF["beam4ret_beam_eos_sequences"]
    sequences = np.asarray(out.sequences)
    assert sequences.shape == expected.shape
    for row, hf_row in zip(sequences, expected):
        wanted = through_first_eos(hf_row)  # HF fills after EOS with EOS, eqxckpt with pad
        np.testing.assert_array_equal(row[: len(wanted)], wanted)
        assert (row[len(wanted) :] == 0).all()
    np.testing.assert_allclose(np.asarray(out.sequences_scores), HF["beam4ret_beam_eos_sequences_scores"], atol=1e-5)


@pytest.mark.parametrize("directory", ["hf", "hf_bf16"])
def test_save_hf_of_a_scanned_t5_writes_the_per_layer_file(tmp_path, directory):
    scanned = t5.load_hf(FIXTURE / directory, dtype="auto", scan_layers=True)
    t5.save_hf(tmp_path / "scanned", scanned)
    t5.save_hf(tmp_path / "per_layer", t5.unscan(scanned))
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        assert (tmp_path / "scanned" / name).read_bytes() == (tmp_path / "per_layer" / name).read_bytes(), name
    ours, theirs = (stn.load_file(str(d / "model.safetensors")) for d in (tmp_path / "scanned", FIXTURE / directory))
    assert sorted(ours) == sorted(theirs)  # HuggingFace's per-block names
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name])
    assert_trees_equal(t5.load_hf(tmp_path / "scanned", dtype="auto", scan_layers=True), scanned)


def test_convert_hf_writes_a_scanned_t5_that_loads_into_its_skeleton(tmp_path, scanned_hf):
    config = t5.convert_hf(FIXTURE / "hf", tmp_path / "t5", scan_layers=True)
    converted = eqxckpt.open(tmp_path / "t5")
    assert converted.metadata["scan_layers"] is True
    assert converted["params/encoder/blocks/feed_forward/wi_0"].shape == (2, 32, 64)
    like = lambda: t5.T5(config, key=jax.random.key(0), scan_layers=True)  # noqa: E731
    assert_trees_equal(eqxckpt.load(tmp_path / "t5", like, at="params"), scanned_hf)


def test_scanned_load_hf_reads_each_tensor_once_straight_into_the_stacked_leaves(monkeypatch):
    from eqxckpt._formats._safetensors import _read as _safetensors
    from eqxckpt._read import _restack, _restore

    reads, stacked = [], []
    read_range, read_layouts = _safetensors.read_range, _restore._read_layouts
    monkeypatch.setattr(
        _safetensors,
        "read_range",
        lambda fd, offset, buffer, path: (reads.append(path), read_range(fd, offset, buffer, path))[1],
    )

    def spied_read_layouts(source, layouts):
        stacked.extend(layout.leaf.path for layout, _ in layouts if isinstance(layout, _restack.Stacked))
        return read_layouts(source, layouts)

    monkeypatch.setattr(_restore, "_read_layouts", spied_read_layouts)
    model = t5.load_hf(FIXTURE / "hf", scan_layers=True)
    assert len(reads) == len(set(reads)) == 52
    # Every stacked leaf came from eqxckpt.Stack, not from a per-layer model stacked afterwards.
    assert sorted(stacked) == sorted(p for p in paths_and_shapes(model) if "/blocks/" in p)
    assert len(stacked) == 9 + 14  # encoder: 2 norms, 4 + 3 weights; decoder: 3 norms, 8 + 3 weights


def test_misfits_are_named_by_their_huggingface_names_in_either_layout(tmp_path):
    def damage(tensors):
        del tensors["decoder.block.1.layer.2.DenseReluDense.wo.weight"]
        tensors["encoder.block.0.layer.0.SelfAttention.q.weight"] = np.zeros((64, 32), np.float32)
        tensors["encoder.block.1.layer.0.SelfAttention.extra.weight"] = np.zeros(3, np.float32)

    directory = edited_hf_copy(tmp_path / "bad", damage)
    errors = []
    for scan_layers in (False, True):
        with pytest.raises(eqxckpt.StructureMismatchError) as info:
            t5.load_hf(directory, scan_layers=scan_layers)
        errors.append(info.value)
    per_layer, scanned = errors
    # A tensor no block takes is refused too, though a load with transforms would drop it.
    assert str(scanned) == str(per_layer)
    assert (scanned.missing, scanned.unexpected, scanned.mismatched) == (
        per_layer.missing,
        per_layer.unexpected,
        per_layer.mismatched,
    )
    assert "named decoder.block.1.layer.2.DenseReluDense.wo.weight in the files" in str(scanned)
    assert "stored as encoder.block.1.layer.0.SelfAttention.extra.weight" in str(scanned)


def test_config_json_of_a_scanned_save_is_huggingfaces(tmp_path, scanned_hf):
    t5.save_hf(tmp_path / "out", scanned_hf)
    assert json.loads((tmp_path / "out/config.json").read_text()) == json.loads(
        (FIXTURE / "hf/config.json").read_text()
    )


def test_per_layer_relative_attention_biases_load_stacked(tmp_path):
    # HuggingFace's T5 has one table per stack, so save_hf refuses these; write the files by hand.
    from eqxckpt.t5._hf import TRANSPOSED, hf_config, hf_name

    model = t5.T5(SMALL, key=jax.random.key(4))
    tensors = {
        hf_name(path, SMALL): np.ascontiguousarray(np.asarray(leaf).T if TRANSPOSED.fullmatch(path) else leaf)
        for path, _, leaf in flatten(model)[0]
        if isinstance(leaf, jax.Array)
    }
    assert "decoder.block.2.layer.0.SelfAttention.relative_attention_bias.weight" in tensors
    stn.save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = {**hf_config(SMALL, np.float32), "relative_attention_per_layer": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_trees_equal(t5.load_hf(tmp_path, scan_layers=True), t5.scan(model))
    assert_trees_equal(t5.load_hf(tmp_path), model)


# -- Found by an outside attack on the scanned T5 (each failed before its fix) --------------


@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_a_file_whose_blocks_differ_in_dtype_loads_scanned_as_per_layer(tmp_path, dtype):
    """One block's norm stored in float16 among float32 tensors: the per-layer load casts it
    as it casts everything; the scanned one refused ("the layers differ in shape or dtype")
    though each layer is cast to the one dtype anyway."""
    name = "decoder.block.1.layer.2.layer_norm.weight"
    directory = edited_hf_copy(
        tmp_path / "mixed", lambda tensors: tensors.update({name: tensors[name].astype(np.float16)})
    )
    per_layer = t5.load_hf(directory, dtype=dtype)
    assert_trees_equal(t5.load_hf(directory, dtype=dtype, scan_layers=True), t5.scan(per_layer))
    # Kept as stored ("auto"): one stacked array holds every block's dtype exactly (float32).
    auto = t5.load_hf(directory, dtype="auto", scan_layers=True)
    assert auto.decoder.blocks.feed_forward_norm.scale.dtype == jnp.float32
    assert_trees_equal(auto, t5.scan(t5.load_hf(directory)))


def test_a_t5_with_one_stack_scanned_is_scanned_unscanned_and_published_whole(tmp_path):
    """Built by hand, an encoder stacked beside a per-layer decoder: `scan` and `unscan`
    returned it unchanged, and `save_hf` wrote its stacked leaves under names holding
    '{i}', transposed in every axis, without an error."""
    per_layer = t5.T5(dataclasses.replace(SMALL, relative_attention_per_layer=False), key=jax.random.key(0))
    mixed = eqx.tree_at(lambda m: m.encoder.blocks, per_layer, t5.scan(per_layer).encoder.blocks)
    assert not mixed.scan_layers
    assert_trees_equal(t5.unscan(mixed), per_layer)
    assert_trees_equal(t5.scan(mixed), t5.scan(per_layer))
    t5.save_hf(tmp_path / "mixed", mixed)
    t5.save_hf(tmp_path / "per_layer", per_layer)
    assert (tmp_path / "mixed/model.safetensors").read_bytes() == (
        tmp_path / "per_layer/model.safetensors"
    ).read_bytes()
