"""The Equinox T5 against an independent implementation's outputs (tests/fixtures,
copied from ../shared/t5), read from a real Mesh TensorFlow checkpoint."""

import dataclasses
import pathlib
import subprocess
import sys

import equinox as eqx
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxckpt
from eqxckpt import t5
from eqxckpt.t5 import _config as t5_config

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "t5_v1_1_tiny"
REF = np.load(FIXTURE / "reference.npz")


@eqx.filter_jit
def outputs(model, ids, decoder_ids, mask):
    """Encoder outputs and logits of ``model`` on a batch, compiled: run eagerly, each
    operation under `vmap` is dispatched and compiled alone (10 s and more a call)."""
    encoded = jax.vmap(lambda i, m: model.encode(i, attention_mask=m))(ids, mask)
    return encoded, jax.vmap(lambda i, d, m: model(i, d, attention_mask=m))(ids, decoder_ids, mask)


def run(model, prefix=""):
    """Encoder output and logits of ``model`` on the reference batch (``prefix="short_"``: the short one)."""
    ids, mask = REF[prefix + "input_ids"], REF[prefix + "attention_mask"]
    encoded, logits = outputs(model, ids, REF[prefix + "decoder_input_ids"], mask)
    return np.asarray(encoded), np.asarray(logits)


def test_relative_position_buckets_match_exactly():
    rp = REF["rp_relative_position"]
    np.testing.assert_array_equal(t5.relative_position_bucket(rp, bidirectional=True), REF["rp_bucket_bidirectional"])
    np.testing.assert_array_equal(t5.relative_position_bucket(rp, bidirectional=False), REF["rp_bucket_causal"])


@pytest.fixture(scope="module")
def model32():
    return t5.load_tf(FIXTURE, dtype=jnp.float32)


@pytest.mark.tf
def test_config_is_inferred_from_the_checkpoint(model32):
    assert model32.config == t5.T5Config.from_json(FIXTURE / "config.json")
    assert model32.shared.dtype == jnp.float32 and model32.logits_kernel.shape == (32, 512)


@pytest.mark.tf
@pytest.mark.parametrize("prefix", ["", "short_"])
def test_float32_matches_the_reference(model32, prefix):
    encoded, logits = run(model32, prefix)
    np.testing.assert_allclose(encoded, REF[prefix + "encoder_last_hidden_state"], atol=2e-5, rtol=0)
    np.testing.assert_allclose(logits, REF[prefix + "logits"], atol=2e-5, rtol=0)


@pytest.mark.tf
def test_position_biases_match_exactly(model32):
    for stack, length, name in (
        ("encoder", 7, "short_encoder_position_bias"),
        ("decoder", 5, "short_decoder_position_bias"),
    ):
        module = getattr(model32, stack)
        np.testing.assert_array_equal(module.position_bias(module.relative_attention_bias, length), REF[name])


@pytest.mark.multiprocess
@pytest.mark.tf
def test_float64_matches_the_float64_reference_to_1e_9():
    # The reference's *_f64 arrays come from a float64-clean run (NOTES.md): float64
    # noise is ~1e-14, so 1e-9 catches any float32 step (~1e-6) inside a float64 path.
    script = f"""
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np
from eqxckpt import t5
ref = np.load({str(FIXTURE / "reference.npz")!r})
model = t5.load_tf({str(FIXTURE)!r}, dtype=jnp.float64)
@jax.jit  # compiled once for the two batches' shapes, rather than op by op (20 s and more)
def outputs(ids, dec, mask):
    encoded = jax.vmap(lambda i, m: model.encode(i, attention_mask=m))(ids, mask)
    return encoded, jax.vmap(lambda i, d, m: model(i, d, attention_mask=m))(ids, dec, mask)
for prefix in ("", "short_"):
    ids, mask, dec = (ref[prefix + name] for name in ("input_ids", "attention_mask", "decoder_input_ids"))
    encoded, logits = outputs(ids, dec, mask)
    assert encoded.dtype == logits.dtype == jnp.float64
    print(prefix or "main", np.abs(np.asarray(encoded) - ref[prefix + "encoder_last_hidden_state_f64"]).max(),
          np.abs(np.asarray(logits) - ref[prefix + "logits_f64"]).max())
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split() for line in result.stdout.strip().splitlines()]
    assert [row[0] for row in rows] == ["main", "short_"]
    for _, encoder_error, logits_error in rows:
        assert float(encoder_error) < 1e-9 and float(logits_error) < 1e-9, rows


@pytest.mark.tf
def test_default_dtype_is_float32_and_auto_keeps_bfloat16():
    assert jax.tree_util.tree_leaves(t5.load_tf(FIXTURE))[0].dtype == jnp.float32
    stored = t5.load_tf(FIXTURE, dtype="auto")
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(stored)} == {jnp.dtype(jnp.bfloat16)}
    with pytest.raises(eqxckpt.CheckpointError, match="not a dtype"):
        t5.load_tf(FIXTURE, dtype="float33")


@pytest.mark.tf
def test_convert_tf_docstring_example_works_on_a_bfloat16_checkpoint(tmp_path, model32):
    # The documented call, as written: no dtype, a float32 skeleton.
    config = t5.convert_tf(FIXTURE, tmp_path / "t5_eqx")
    model = eqxckpt.load(tmp_path / "t5_eqx", lambda: t5.T5(config, key=jax.random.key(0)), at="params")
    np.testing.assert_array_equal(run(model)[1], run(model32)[1])


@pytest.mark.tf
def test_convert_then_load_gives_the_same_model(tmp_path, model32):
    config = t5.convert_tf(FIXTURE, tmp_path / "t5", dtype=jnp.float32)
    ckpt = eqxckpt.open(tmp_path / "t5")
    assert ckpt["step"] == 100 and ckpt.metadata["t5_config"]["num_heads"] == 2
    assert ckpt["adafactor/v/shared"].shape == (512, 32)
    loaded = eqxckpt.load(tmp_path / "t5", lambda: t5.T5(config, key=jax.random.key(0)), at="params")
    np.testing.assert_array_equal(run(loaded)[1], run(model32)[1])


@pytest.mark.multiprocess
def test_missing_tensorflow_is_a_clear_error(tmp_path):
    script = f"""
import sys
sys.modules["tensorflow"] = None  # as if it were not installed
from eqxckpt import t5
try:
    t5.load_tf({str(FIXTURE)!r})
except Exception as e:
    print(type(e).__name__, e)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "CheckpointError" in result.stdout and "pip install 'eqxckpt[tf]'" in result.stdout, (
        result.stdout + result.stderr
    )


@pytest.mark.multiprocess
@pytest.mark.tf
def test_import_t5_command_round_trip(tmp_path, model32):
    result = subprocess.run(
        [sys.executable, "-m", "eqxckpt", "import-t5", str(FIXTURE), str(tmp_path / "t5"), "--dtype", "float32"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "wrote" in result.stdout and "vocab 512" in result.stdout
    config = t5.T5Config(**eqxckpt.open(tmp_path / "t5").metadata["t5_config"])
    loaded = eqxckpt.load(tmp_path / "t5", lambda: t5.T5(config, key=jax.random.key(0)), at="params")
    np.testing.assert_array_equal(run(loaded)[1], run(model32)[1])


# --- v1.0 checkpoints written here with TensorFlow ------------------------------------

V10 = t5.T5Config(
    vocab_size=256,
    d_model=128,
    d_kv=16,
    d_ff=256,
    num_layers=2,
    num_heads=2,
    feed_forward_proj="relu",
    tie_word_embeddings=True,
)
SUBLAYER_INDEX = {"self_attention": 0, "cross_attention": 1}


def mtf_name(path: str) -> str:
    """Our parameter path -> the Mesh TensorFlow name (v1.0's norm names, ``wi`` for an ungated FFN)."""
    parts = path.split("/")
    if path == "shared":
        return "shared/embedding"
    if path == "logits_kernel":
        return "decoder/logits/kernel"
    stack = parts[0]
    if parts[1] == "relative_attention_bias":
        return f"{stack}/block_000/layer_000/SelfAttention/relative_attention_bias"
    if parts[1] == "final_norm":
        return f"{stack}/final_layer_norm/scale"
    block, sub, leaf = f"block_{int(parts[2]):03d}", parts[3], parts[-1]
    if sub == "relative_attention_bias":  # one table per block
        return f"{stack}/{block}/layer_000/SelfAttention/relative_attention_bias"
    ffn_layer = 1 if stack == "encoder" else 2
    if sub.endswith("_norm"):
        layer = ffn_layer if sub == "feed_forward_norm" else SUBLAYER_INDEX[sub[: -len("_norm")]]
        return f"{stack}/{block}/layer_{layer:03d}/layer_norm/scale"
    if sub == "feed_forward":
        return f"{stack}/{block}/layer_{ffn_layer:03d}/DenseReluDense/{'wi' if leaf == 'wi_0' else leaf}/kernel"
    kind = "SelfAttention" if sub == "self_attention" else "EncDecAttention"
    return f"{stack}/{block}/layer_{SUBLAYER_INDEX[sub]:03d}/{kind}/{leaf}"


def write_tf_checkpoint(directory: pathlib.Path, model, *, drop=(), extra=(), gated=False) -> dict:
    """A TF1-style checkpoint (as Mesh TensorFlow writes) of ``model``'s weights, with
    Adafactor slots (factored where the second-largest dim >= 128) and global_step."""
    from conftest import save_tf_tensors

    from eqxckpt._tree import flatten

    tensors = {}
    for path, _, leaf in flatten(model)[0]:
        if isinstance(leaf, jax.Array):
            name, value = mtf_name(path), np.asarray(leaf)
            if gated:
                name = name.replace("/wi/", "/wi_0/")
            tensors[name] = value
            dims = sorted(range(value.ndim), key=lambda d: value.shape[d])
            if value.ndim >= 2 and value.shape[dims[-2]] >= 128:
                tensors[name + "_slot_vr"] = np.abs(value).mean(axis=dims[-1])
                tensors[name + "_slot_vc"] = np.abs(value).mean(axis=dims[-2])
            else:
                tensors[name + "_slot_v"] = np.square(value)
    tensors["global_step"] = np.int64(7)
    for name in drop:
        del tensors[name]
    tensors.update(extra)
    save_tf_tensors(directory, tensors)
    return tensors


@pytest.fixture(scope="module")
def v10(tmp_path_factory):
    model = t5.T5(V10, key=jax.random.key(3))
    directory = tmp_path_factory.mktemp("v10") / "ckpt"
    return model, directory, write_tf_checkpoint(directory, model)


@pytest.mark.tf
def test_v10_checkpoint_imports_end_to_end(v10, tmp_path):
    model, directory, tensors = v10
    imported = t5.load_tf(directory)  # config inferred: tied, ReLU, layer_norm names
    assert (
        imported.config == V10
        and imported.logits_kernel is None
        and imported.encoder.blocks[0].feed_forward.wi_1 is None
    )
    from conftest import assert_trees_equal

    assert_trees_equal(imported, model)
    ids, dec = jnp.arange(1, 12) % 256, jnp.array([0, 5, 9, 2])

    @eqx.filter_jit  # each side compiled whole, not dispatched op by op
    def by_hand(model, ids, dec):
        hidden = model.decoder(
            model.shared[dec], jnp.tril(jnp.ones((4, 4), bool)), model.encode(ids), jnp.ones((1, 11), bool)
        )
        return (hidden * 128**-0.5) @ model.shared.T

    np.testing.assert_allclose(
        eqx.filter_jit(imported)(ids, dec), by_hand(imported, ids, dec), rtol=1e-6, atol=1e-6
    )  # tied, scaled
    t5.convert_tf(directory, tmp_path / "eqx")
    ckpt = eqxckpt.open(tmp_path / "eqx")
    assert ckpt["step"] == 7
    np.testing.assert_array_equal(ckpt["adafactor/v_row/shared"].get(), tensors["shared/embedding_slot_vr"])  # factored
    np.testing.assert_array_equal(ckpt["adafactor/v_col/shared"].get(), tensors["shared/embedding_slot_vc"])
    np.testing.assert_array_equal(
        ckpt["adafactor/v/encoder/blocks/0/self_attention/q"].get(),
        tensors["encoder/block_000/layer_000/SelfAttention/q_slot_v"],
    )


@pytest.mark.tf
def test_unknown_missing_and_misfit_variables_are_named(v10, tmp_path):
    model, directory, _ = v10
    write_tf_checkpoint(
        tmp_path / "unknown", model, extra={"encoder/block_000/layer_000/SelfAttention/extra": np.zeros(3)}
    )
    with pytest.raises(eqxckpt.TransformError, match="encoder/block_000/layer_000/SelfAttention/extra"):
        t5.load_tf(tmp_path / "unknown")
    gone = "decoder/block_001/layer_002/DenseReluDense/wo/kernel"
    write_tf_checkpoint(tmp_path / "missing", model, drop=[gone])
    with pytest.raises(
        eqxckpt.StructureMismatchError,
        match=r"missing from the checkpoint \(1\):\n    decoder/blocks/1/feed_forward/wo:",
    ):
        t5.load_tf(tmp_path / "missing")
    wrong = dataclasses.replace(V10, num_heads=4)  # 4 heads x 16 = 64, but the kernels are 128 x 32
    with pytest.raises(eqxckpt.StructureMismatchError) as info:
        t5.load_tf(directory, wrong)
    assert (
        "encoder/blocks/0/self_attention/q: expected float32[128,64], found float32[128,32], "
        "stored as encoder/block_000/layer_000/SelfAttention/q"
    ) in str(info.value)


# --- gin files: Mesh TensorFlow's operative_config.gin beside the checkpoint ----------

GIN = pathlib.Path(__file__).parent / "fixtures" / "mtf_tiny_t5.operative_config.gin"
# What that real gin file describes (the vocabulary size comes from the shapes).
TINY = t5.T5Config(
    vocab_size=64,
    d_model=32,
    d_kv=64,
    d_ff=64,
    num_layers=2,
    num_heads=2,
    feed_forward_proj="gated-gelu",
    tie_word_embeddings=False,
)


def test_real_gin_file_gives_the_tiny_config():
    assert t5.T5Config.from_gin(GIN, vocab_size=64) == TINY


@pytest.fixture(scope="module")
def per_layer(tmp_path_factory):
    """A checkpoint whose blocks each have their own relative attention bias."""
    config = dataclasses.replace(TINY, relative_attention_per_layer=True)
    model = t5.T5(config, key=jax.random.key(5))
    directory = tmp_path_factory.mktemp("per_layer") / "ckpt"
    write_tf_checkpoint(directory, model, gated=True)
    return model, directory


@pytest.mark.multiprocess
@pytest.mark.tf
def test_per_layer_relative_attention_bias_is_read_from_gin(per_layer, tmp_path):
    from conftest import assert_trees_equal

    model, directory = per_layer
    gin = directory / "operative_config.gin"
    gin.write_text(GIN.read_text().replace("'bias_shared'", "'bias'"))
    try:
        imported = t5.load_tf(directory)
        assert imported.config.relative_attention_per_layer and imported.decoder.relative_attention_bias is None
        assert_trees_equal(imported, model)
        result = subprocess.run(
            [sys.executable, "-m", "eqxckpt", "import-t5", str(directory), str(tmp_path / "out")],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert eqxckpt.open(tmp_path / "out").metadata["t5_config"]["relative_attention_per_layer"] is True
    finally:
        gin.unlink()


@pytest.mark.tf
def test_gin_that_disagrees_with_the_shapes_is_named(per_layer):
    model, directory = per_layer
    gin = directory / "operative_config.gin"
    gin.write_text(GIN.read_text().replace("d_ff = 64", "d_ff = 128"))  # and 'bias_shared', but per-layer tables
    try:
        with pytest.raises(eqxckpt.CheckpointError) as info:
            t5.load_tf(directory)
        message = str(info.value)
        assert "does not describe the checkpoint" in message
        assert "d_ff: 128 in the gin file, 64 from the variables' shapes" in message
        assert "relative_attention_per_layer: False in the gin file, True from the variables' shapes" in message
    finally:
        gin.unlink()


def test_unsupported_relative_attention_type_is_refused(tmp_path):
    gin = tmp_path / "operative_config.gin"
    gin.write_text(
        GIN.read_text().replace(
            "encoder/SelfAttention.relative_attention_type = 'bias_shared'",
            "encoder/SelfAttention.relative_attention_type = 'contextual'",
        )
    )
    with pytest.raises(eqxckpt.CheckpointError, match="encoder/SelfAttention.relative_attention_type = 'contextual'"):
        t5.T5Config.from_gin(gin)
    gin.write_text(
        GIN.read_text().replace(
            "encoder/SelfAttention.relative_attention_type = 'bias_shared'",
            "encoder/SelfAttention.relative_attention_type = 'bias'",
        )
    )
    with pytest.raises(eqxckpt.CheckpointError, match="different relative_attention_type"):
        t5.T5Config.from_gin(gin)


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(st.text(alphabet=st.sampled_from("ab_/.=%@'\"[],-+e0123456789 \n\t#()"), max_size=200))
def test_gin_parser_never_runs_anything_or_crashes(text):
    bindings = t5_config.parse_gin(text)
    assert all(isinstance(name, str) for name in bindings)
    try:
        t5_config.T5Config.from_dict({k.rsplit(".", 1)[-1]: v for k, v in bindings.items()})
    except eqxckpt.CheckpointError:
        pass  # refused by name; anything else would be a crash


@pytest.mark.parametrize(
    "binding, match",
    [
        ("encoder/SelfAttention.relative_attention_type = ['bias']", "relative_attention_type = \\['bias'\\]"),
        ("d_model = " + "7" * 4000, "d_model must be an integer from 1 to 65536"),
        ("d_ff = [1, 2]", "d_ff must be an integer"),
        ("num_layers = 100000", "num_layers must be an integer from 1 to 256"),
    ],
)
def test_gin_values_of_the_wrong_type_or_size_are_clear_errors(tmp_path, binding, match):
    gin = tmp_path / "operative_config.gin"
    gin.write_text(GIN.read_text() + "\n" + binding + "\n")
    with pytest.raises(eqxckpt.CheckpointError, match=match):
        t5.T5Config.from_gin(gin, vocab_size=64)


@pytest.mark.tf
def test_a_gin_config_larger_than_the_weights_is_refused_before_a_skeleton_is_built(tmp_path):
    """The same bound as for HuggingFace directories: the checkpoint's bytes must hold
    at least a byte per weight the config describes (256 blocks against a 2-block checkpoint)."""
    gin = tmp_path / "operative_config.gin"
    gin.write_text(GIN.read_text() + "\nnum_layers = 256\nd_ff = 100000\n")
    with pytest.raises(eqxckpt.StructureMismatchError, match="at least .* weights, but the files hold only"):
        t5.load_tf(FIXTURE, gin)
