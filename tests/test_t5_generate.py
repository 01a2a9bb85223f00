"""`eqxckpt.t5.generate` against HuggingFace transformers' own generate() on the same
model (tests/fixtures/t5_v1_1_tiny/generation.npz, copied from ../shared/t5)."""

import dataclasses
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqxckpt import t5
from eqxckpt.t5 import _generate

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "t5_v1_1_tiny"
HF = np.load(FIXTURE / "generation.npz")
BATCHES = ["main", "short", "eos_mix", "eos_all", "beam_eos"]
EOS = 1


def max_new_tokens(batch: str) -> int:
    return 48 if batch in ("main", "short") else 64


def inputs(batch: str) -> tuple[np.ndarray, np.ndarray]:
    return HF[f"{batch}_input_ids"], HF[f"{batch}_attention_mask"]


def through_first_eos(row: np.ndarray) -> np.ndarray:
    ends = np.flatnonzero(row == EOS)
    return row[: ends[0] + 1] if len(ends) else row


@pytest.fixture(scope="module")
def model():
    return t5.load_tf(FIXTURE)


@pytest.mark.tf
@pytest.mark.parametrize("batch", BATCHES)
def test_greedy_matches_huggingface(model, batch):
    out = t5.generate(model, *inputs(batch), max_new_tokens=max_new_tokens(batch))
    expected = HF[f"greedy_{batch}_sequences"]
    # Token for token, the shape included: rows after their EOS hold pad 0, and the
    # loop stops when every row has finished (eos_all: after 41 of 64 steps).
    np.testing.assert_array_equal(np.asarray(out.sequences), expected)
    unfinished = ~HF[f"greedy_{batch}_finished"]
    assert out.scores is not None and out.sequences_scores is None
    np.testing.assert_allclose(np.asarray(out.scores)[unfinished], HF[f"greedy_{batch}_scores"][unfinished], atol=1e-5)


@pytest.mark.tf
def test_greedy_stops_once_every_row_has_finished(model):
    out = t5.generate(model, *inputs("eos_all"), max_new_tokens=64)
    assert out.sequences.shape == (3, 42)
    eos_steps = [int(np.flatnonzero(row == EOS)[0]) for row in np.asarray(out.sequences)]
    assert eos_steps == [26, 10, 41]
    for row, step in zip(np.asarray(out.sequences), eos_steps):
        assert (row[step + 1 :] == 0).all()  # padded after EOS


@pytest.mark.tf
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("returned", [1, 4])
def test_beam_search_matches_huggingface(model, batch, returned):
    name = "beam" if returned == 1 else "beam4ret"
    out = t5.generate(
        model, *inputs(batch), max_new_tokens=max_new_tokens(batch), num_beams=4, num_return_sequences=returned
    )
    expected = HF[f"{name}_{batch}_sequences"]
    sequences = np.asarray(out.sequences)
    assert sequences.shape == expected.shape and out.scores is None and out.sequences_scores is not None
    for row, hf_row in zip(sequences, expected):
        wanted = through_first_eos(hf_row)  # HF fills after EOS with EOS, eqxckpt with pad
        np.testing.assert_array_equal(row[: len(wanted)], wanted)
        assert (row[len(wanted) :] == 0).all()
    np.testing.assert_allclose(np.asarray(out.sequences_scores), HF[f"{name}_{batch}_sequences_scores"], atol=1e-5)


@pytest.mark.tf
def test_beams_that_end_in_eos_are_returned_best_first(model):
    out = t5.generate(model, *inputs("beam_eos"), max_new_tokens=64, num_beams=4, num_return_sequences=4)
    lengths = [len(through_first_eos(row)) - 1 for row in np.asarray(out.sequences)]
    # Returned beams that end in EOS (HF's): the best of inputs 0 and 1 at steps 9 and 42,
    # the 2nd of input 2 at step 30 and the 4th of input 3 at step 61; the rest run to 64.
    assert {i: n for i, n in enumerate(lengths) if n < 64} == {0: 9, 4: 42, 9: 30, 15: 61}
    scores = np.asarray(out.sequences_scores).reshape(5, 4)
    assert (np.diff(scores, axis=1) <= 0).all()


@pytest.mark.tf
@pytest.mark.parametrize(
    "config",
    [
        # v1.0: tied output layer, ReLU, and one relative attention table per block.
        t5.T5Config(vocab_size=97, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=3, num_heads=2),
        t5.T5Config(
            vocab_size=97,
            d_model=16,
            d_kv=8,
            d_ff=32,
            num_layers=1,
            num_heads=2,
            feed_forward_proj="gated-gelu",
            tie_word_embeddings=False,
            relative_attention_per_layer=True,
        ),
    ],
)
def test_cached_decoding_equals_recomputing_the_prefix(config):
    model = t5.T5(config, key=jax.random.key(1))
    ids = jax.random.randint(jax.random.key(2), (3, 9), 2, config.vocab_size)
    mask = jnp.arange(9)[None, :] < jnp.array([[9], [5], [2]])
    for beams in (1, 3):
        cached = t5.generate(model, ids, mask, max_new_tokens=20, num_beams=beams, eos_token_id=None)
        recomputed = t5.generate(
            model, ids, mask, max_new_tokens=20, num_beams=beams, eos_token_id=None, use_cache=False
        )
        np.testing.assert_array_equal(np.asarray(cached.sequences), np.asarray(recomputed.sequences))
        assert cached.sequences.shape == (3, 21)
        for field in ("scores", "sequences_scores"):
            if getattr(cached, field) is not None:
                np.testing.assert_allclose(getattr(cached, field), getattr(recomputed, field), atol=1e-5)
    # And each step's logits equal the teacher-forced decoder's on the generated tokens
    # (compiled whole: run eagerly, each operation under vmap is compiled alone, 10 s).
    greedy = t5.generate(model, ids, mask, max_new_tokens=20, eos_token_id=None)
    tokens = np.asarray(greedy.sequences)
    teacher_forced = eqx.filter_jit(jax.vmap(lambda i, d, m: model(i, d, attention_mask=m)))
    logits = teacher_forced(ids, tokens[:, :-1], mask)
    chosen = np.take_along_axis(np.asarray(logits), tokens[:, 1:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(greedy.scores, chosen, atol=1e-5)


@pytest.mark.tf
def test_the_whole_loop_is_one_compiled_while_loop(model):
    """No Python loop over tokens: the traced program is the same size for 4 or 64 tokens."""
    ids, mask = (jnp.asarray(x) for x in inputs("short"))
    tokens = _generate.Tokens(0, 1, 0)

    def program(fn, *args):
        params, static = eqx.partition(model, eqx.is_array)
        jaxpr = jax.make_jaxpr(lambda p: fn(eqx.combine(p, static), ids, mask, *args))(params)
        return str(jaxpr)

    for fn, rest in (
        (_generate._greedy.__wrapped__, (tokens, True)),
        (_generate._beam_search.__wrapped__, (4, 2, tokens, 1.0, True)),
    ):
        short, long = program(fn, 4, *rest), program(fn, 64, *rest)
        assert "while[" in short
        assert short.count("dot_general") == long.count("dot_general")


@pytest.mark.tf
def test_bad_arguments_are_refused(model):
    ids, mask = inputs("short")
    with pytest.raises(ValueError, match="num_return_sequences"):
        t5.generate(model, ids, mask, max_new_tokens=4, num_return_sequences=2)
    with pytest.raises(ValueError, match="attention_mask is"):
        t5.generate(model, ids, mask[:, :3], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        t5.generate(model, ids[0], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        t5.generate(model, ids, max_new_tokens=0)


@pytest.mark.tf
def test_bfloat16_model_generates_with_float32_scores():
    model = t5.load_tf(FIXTURE, dtype=jnp.bfloat16)
    out = t5.generate(model, *inputs("short"), max_new_tokens=8)
    assert out.scores is not None and out.scores.dtype == jnp.float32 and out.sequences.shape == (2, 9)
    assert dataclasses.is_dataclass(out)
