"""The Equinox T5 against an independent implementation's outputs (tests/fixtures,
copied from ../shared/t5), read from a real Mesh TensorFlow checkpoint."""

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxckpt
from eqxckpt import t5

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "t5_v1_1_tiny"
REF = np.load(FIXTURE / "reference.npz")


def run(model, prefix=""):
    encode = jax.vmap(lambda i, m: model.encode(i, attention_mask=m))
    logits = jax.vmap(lambda i, d, m: model(i, d, attention_mask=m))
    return (np.asarray(encode(REF[prefix + "input_ids"], REF[prefix + "attention_mask"])),
            np.asarray(logits(REF["input_ids"], REF["decoder_input_ids"], REF["attention_mask"])))


def test_relative_position_buckets_match_exactly():
    rp = REF["rp_relative_position"]
    np.testing.assert_array_equal(t5.relative_position_bucket(rp, bidirectional=True), REF["rp_bucket_bidirectional"])
    np.testing.assert_array_equal(t5.relative_position_bucket(rp, bidirectional=False), REF["rp_bucket_causal"])


@pytest.fixture(scope="module")
def model32():
    return t5.load_tf(FIXTURE, dtype=jnp.float32)


def test_config_is_inferred_from_the_checkpoint(model32):
    assert model32.config == t5.T5Config.from_json(FIXTURE / "config.json")
    assert model32.shared.dtype == jnp.float32 and model32.logits_kernel.shape == (32, 512)


def test_float32_matches_the_reference(model32):
    encoded, logits = run(model32)
    np.testing.assert_allclose(encoded, REF["encoder_last_hidden_state"], atol=2e-5, rtol=0)
    np.testing.assert_allclose(logits, REF["logits"], atol=2e-5, rtol=0)
    for stack, length, name in (("encoder", 7, "short_encoder_position_bias"), ("decoder", 5, "short_decoder_position_bias")):
        module = getattr(model32, stack)
        np.testing.assert_array_equal(module.position_bias(module.relative_attention_bias, length), REF[name])


def test_float64_matches_the_reference_closely():
    # Known gap (see the issue note): our float64 agrees with an independent numpy
    # float64 implementation to 2e-15 but with the reference's *_f64 only to ~1e-6.
    script = f"""
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np
from eqxckpt import t5
ref = np.load({str(FIXTURE / "reference.npz")!r})
model = t5.load_tf({str(FIXTURE)!r}, dtype=jnp.float64)
logits = jax.vmap(lambda i, d, m: model(i, d, attention_mask=m))(ref["input_ids"], ref["decoder_input_ids"], ref["attention_mask"])
assert logits.dtype == jnp.float64
print(float(np.abs(np.asarray(logits) - ref["logits_f64"]).max()))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert float(result.stdout.strip().splitlines()[-1]) < 2e-6


def test_convert_then_load_gives_the_same_model(tmp_path, model32):
    config = t5.convert_tf(FIXTURE, tmp_path / "t5", dtype=jnp.float32)
    ckpt = eqxckpt.open(tmp_path / "t5")
    assert ckpt["step"] == 100 and ckpt.metadata["t5_config"]["num_heads"] == 2
    assert ckpt["adafactor/v/shared"].shape == (512, 32)
    loaded = eqxckpt.load(tmp_path / "t5", lambda: t5.T5(config, key=jax.random.key(0)), at="params")
    np.testing.assert_array_equal(run(loaded)[1], run(model32)[1])


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
    assert "CheckpointError" in result.stdout and "pip install 'eqxckpt[tf]'" in result.stdout, result.stdout + result.stderr


def test_import_t5_command_round_trip(tmp_path, model32):
    result = subprocess.run([sys.executable, "-m", "eqxckpt", "import-t5", str(FIXTURE), str(tmp_path / "t5"),
                             "--dtype", "float32"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "wrote" in result.stdout and "vocab 512" in result.stdout
    config = t5.T5Config(**eqxckpt.open(tmp_path / "t5").metadata["t5_config"])
    loaded = eqxckpt.load(tmp_path / "t5", lambda: t5.T5(config, key=jax.random.key(0)), at="params")
    np.testing.assert_array_equal(run(loaded)[1], run(model32)[1])
