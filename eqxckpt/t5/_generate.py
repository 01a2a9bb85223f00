"""`generate`: greedy and beam-search decoding, the whole loop compiled.

The encoder runs once; the decoder runs one position per step with a key/value
cache, inside `jax.lax.while_loop`, on fixed-size buffers (``1 + max_new_tokens``
positions), so one compilation serves every step and the loop stops as soon as
every row has finished. Beam search follows HuggingFace transformers' rules
(``length_penalty``, ``early_stopping=False``) step for step, so it returns the
same beams.
"""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ._model import T5, Cache

# HuggingFace's score for "not a candidate": large, yet finite so sums stay ordered.
NOT_A_CANDIDATE = -1.0e9


class GenerateOutput(eqx.Module):
    """What `generate` returns.

    - `sequences`: ``[batch * num_return_sequences, 1 + steps]`` token ids, each
      starting with the decoder start token; ``pad_token_id`` after a row's EOS.
    - `scores`: greedy only, ``[batch, steps]``: the logit of each chosen token
      (for a finished row, of the pad token it gets); None for beam search.
    - `sequences_scores`: beam search only, ``[batch * num_return_sequences]``:
      the sum of the generated tokens' log-probabilities (EOS included) over
      ``length ** length_penalty``, best first per input; None for greedy.

    ```python
    out = eqxckpt.t5.generate(model, input_ids, max_new_tokens=16, num_beams=4, num_return_sequences=2)
    best = out.sequences[::2]  # each input's best beam
    ```
    """

    sequences: Int[Array, "rows length"]
    scores: Float[Array, "batch steps"] | None
    sequences_scores: Float[Array, " rows"] | None


@dataclasses.dataclass(frozen=True)
class Tokens:
    """The special token ids (``eos=-1``: no end-of-sequence token)."""

    start: int
    eos: int
    pad: int


def generate(
    model: T5,
    input_ids: Int[Array, "batch seq"] | np.ndarray,
    attention_mask: Int[Array, "batch seq"] | np.ndarray | None = None,
    *,
    max_new_tokens: int,
    num_beams: int = 1,
    num_return_sequences: int = 1,
    decoder_start_token_id: int = 0,
    eos_token_id: int | None = 1,
    pad_token_id: int = 0,
    length_penalty: float = 1.0,
    use_cache: bool = True,
) -> GenerateOutput:
    """Generate text from a batch of inputs: greedy (``num_beams=1``) or beam search.

    Matches HuggingFace transformers' ``generate(do_sample=False)``: greedy takes
    the argmax of each step's logits; beam search keeps ``2 * num_beams``
    candidates per step, moves those ending in EOS to the finished set with
    length-normalised scores, and stops an input once ``num_beams`` hypotheses
    are finished and no running beam can beat them (``early_stopping=False``).
    Generation stops when every row has finished or after ``max_new_tokens``.

    **Arguments:**

    - `model`: the `T5`.
    - `input_ids`: ``[batch, seq]`` encoder token ids.
    - `attention_mask`: ``[batch, seq]``, 1 for real tokens, 0 for padding
      (None: all real).
    - `max_new_tokens`: the most tokens generated after the start token.
    - `num_beams`: 1 for greedy decoding, more for beam search.
    - `num_return_sequences`: beams returned per input, best first (at most
      `num_beams`; 1 for greedy).
    - `decoder_start_token_id`, `eos_token_id`, `pad_token_id`: T5's are 0, 1
      and 0. ``eos_token_id=None`` generates exactly `max_new_tokens`.
    - `length_penalty`: beam scores are divided by ``length ** length_penalty``.
    - `use_cache`: False recomputes the whole decoder prefix at every step
      (slower; for comparison).

    **Returns:** a `GenerateOutput`.

    ```python
    out = eqxckpt.t5.generate(model, input_ids, attention_mask, max_new_tokens=32, num_beams=4)
    out.sequences  # [batch, 1 + steps], starting with the decoder start token
    ```
    """
    input_ids = jnp.asarray(input_ids)
    if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError(f"input_ids must be [batch, seq] integers, got {input_ids.dtype}{list(input_ids.shape)}.")
    mask = jnp.ones(input_ids.shape, bool) if attention_mask is None else jnp.asarray(attention_mask).astype(bool)
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask is {list(mask.shape)}, but input_ids is {list(input_ids.shape)}.")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}.")
    if num_beams < 1 or not 1 <= num_return_sequences <= num_beams:
        raise ValueError(
            f"num_return_sequences ({num_return_sequences}) must be between 1 and num_beams ({num_beams}); "
            "greedy decoding (num_beams=1) returns one sequence per input."
        )
    if 2 * num_beams > model.config.vocab_size:
        raise ValueError(f"num_beams={num_beams} needs a vocabulary of at least {2 * num_beams} tokens.")
    tokens = Tokens(decoder_start_token_id, -1 if eos_token_id is None else eos_token_id, pad_token_id)
    ids = input_ids.astype(jnp.int32)
    if num_beams == 1:
        sequences, scores, steps = _greedy(model, ids, mask, max_new_tokens, tokens, use_cache)
        steps = int(steps)
        return GenerateOutput(sequences[:, : 1 + steps], scores[:, :steps], None)
    sequences, sequences_scores, lengths = _beam_search(
        model, ids, mask, max_new_tokens, num_beams, num_return_sequences, tokens, float(length_penalty), use_cache
    )
    return GenerateOutput(sequences[:, : 1 + int(lengths.max())], None, sequences_scores)


class Decoder(eqx.Module):
    """The decoder of a batch of rows (``rows_per_input`` per input): encoder run once,
    cross-attention keys and values computed once, then one position per `step`."""

    model: T5
    memory: Array  # [rows, seq, d_model]
    mask: Array  # [rows, seq]
    cross: Cache | None  # `T5.cross_cache` of each row (rows first); None without a cache
    use_cache: bool = eqx.field(static=True)

    @classmethod
    def start(cls, model: T5, ids: Array, mask: Array, rows_per_input: int, use_cache: bool) -> "Decoder":
        memory = jax.vmap(lambda i, m: model.encode(i, attention_mask=m))(ids, mask)
        memory, mask = jnp.repeat(memory, rows_per_input, axis=0), jnp.repeat(mask, rows_per_input, axis=0)
        cross = jax.vmap(model.cross_cache)(memory) if use_cache else None
        return cls(model, memory, mask, cross, use_cache)

    def init_cache(self, length: int) -> Cache | None:
        if not self.use_cache:
            return None
        rows = self.memory.shape[0]
        return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (rows, *x.shape)), self.model.init_cache(length))

    def step(self, cache: Cache | None, tokens: Array, position: Array) -> tuple[Array, Cache | None]:
        """Each row's next-token logits (float32 or wider) from ``tokens[:, position]``."""
        if cache is None or self.cross is None:  # recompute the whole prefix (later positions are masked out)
            hidden = jax.vmap(self.model.decode_hidden)(tokens, self.memory, self.mask)
            logits = self.model.logits(hidden[:, position])
        else:
            logits, cache = self.model.decode_step(tokens[:, position], position, cache, self.cross, self.mask)
        return logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), cache


@eqx.filter_jit
def _greedy(
    model: T5, ids: Array, mask: Array, max_new_tokens: int, tokens: Tokens, use_cache: bool
) -> tuple[Array, Array, Array]:
    """Fixed-size sequences ``[batch, 1 + max_new_tokens]``, scores, and the steps taken."""
    decoder = Decoder.start(model, ids, mask, 1, use_cache)
    batch, length = ids.shape[0], 1 + max_new_tokens
    sequences = jnp.full((batch, length), tokens.pad, jnp.int32).at[:, 0].set(tokens.start)
    dtype = jnp.promote_types(model.shared.dtype, jnp.float32)

    def unfinished(carry: tuple) -> Array:
        step, _, _, finished, _ = carry
        return (step < max_new_tokens) & ~jnp.all(finished)

    def next_token(carry: tuple) -> tuple:
        step, sequences, scores, finished, cache = carry
        logits, cache = decoder.step(cache, sequences, step)
        chosen = jnp.where(finished, tokens.pad, jnp.argmax(logits, axis=-1)).astype(jnp.int32)
        scores = scores.at[:, step].set(jnp.take_along_axis(logits, chosen[:, None], axis=-1)[:, 0])
        sequences = sequences.at[:, step + 1].set(chosen)
        return step + 1, sequences, scores, finished | (chosen == tokens.eos), cache

    start = (
        jnp.int32(0),
        sequences,
        jnp.zeros((batch, max_new_tokens), dtype),
        jnp.zeros(batch, bool),
        decoder.init_cache(length),
    )
    steps, sequences, scores, _, _ = jax.lax.while_loop(unfinished, next_token, start)
    return sequences, scores, steps


@eqx.filter_jit
def _beam_search(
    model: T5,
    ids: Array,
    mask: Array,
    max_new_tokens: int,
    num_beams: int,
    num_return: int,
    tokens: Tokens,
    length_penalty: float,
    use_cache: bool,
) -> tuple[Array, Array, Array]:
    """The best ``num_return`` finished hypotheses per input: fixed-size sequences,
    their scores, and their generated lengths."""
    decoder = Decoder.start(model, ids, mask, num_beams, use_cache)
    batch, beams, length, vocab = ids.shape[0], num_beams, 1 + max_new_tokens, model.config.vocab_size
    candidates = 2 * beams  # enough that `beams` of them can continue even if the rest end in EOS
    start_sequences = jnp.full((batch, beams, length), tokens.pad, jnp.int32).at[:, :, 0].set(tokens.start)

    def gather(x: Array, index: Array) -> Array:
        """``x[b, index[b, j]]`` for each input b: beams picked per input."""
        return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)

    def penalised(condition: Array) -> Array:
        return condition.astype(jnp.float32) * NOT_A_CANDIDATE

    def unfinished(carry: dict) -> Array:
        return (carry["step"] < max_new_tokens) & jnp.any(carry["improvable"]) & ~carry["all_stopped"]

    def next_token(carry: dict) -> dict:
        step = carry["step"]
        logits, cache = decoder.step(carry["cache"], carry["running"].reshape(batch * beams, length), step)
        log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1).reshape(batch, beams, vocab)
        log_probs = (log_probs + carry["running_scores"][:, :, None]).reshape(batch, beams * vocab)
        top_scores, top_index = jax.lax.top_k(log_probs, candidates)
        top_beam, top_token = top_index // vocab, (top_index % vocab).astype(jnp.int32)
        top_sequences = gather(carry["running"], top_beam).at[:, :, step + 1].set(top_token)
        stops = (top_token == tokens.eos) | (step + 1 >= max_new_tokens)

        # The best `beams` candidates that did not stop keep running.
        continuing = top_scores + penalised(stops)
        _, keep = jax.lax.top_k(continuing, beams)
        running, running_scores = gather(top_sequences, keep), gather(continuing, keep)
        origin = (jnp.arange(batch)[:, None] * beams + gather(top_beam, keep)).reshape(-1)
        if cache is not None:
            cache = jax.tree_util.tree_map(lambda x: x[origin], cache)

        # Stopped candidates among the best `beams` join the finished set, length-normalised.
        generated = step + 1
        joins = stops & (jnp.arange(candidates) < beams)[None, :]
        normalised = top_scores / jnp.power(generated.astype(jnp.float32), length_penalty)
        normalised = normalised + penalised(~carry["improvable"])[:, None] + penalised(~joins)
        merged_scores = jnp.concatenate([carry["scores"], normalised], axis=1)
        _, best = jax.lax.top_k(merged_scores, beams)
        sequences = gather(jnp.concatenate([carry["sequences"], top_sequences], axis=1), best)
        finished = gather(jnp.concatenate([carry["finished"], joins], axis=1), best)
        lengths = gather(jnp.concatenate([carry["lengths"], jnp.full(joins.shape, generated)], axis=1), best)
        scores = gather(merged_scores, best)

        # An input is done once `beams` hypotheses are finished and no running beam,
        # normalised by its current length, beats the worst of them.
        best_running = running_scores[:, 0] / jnp.power(generated.astype(jnp.float32), length_penalty)
        worst_finished = jnp.where(finished, jnp.min(scores, axis=1, keepdims=True), NOT_A_CANDIDATE)
        improvable = carry["improvable"] & jnp.any(best_running[:, None] > worst_finished, axis=1)
        return dict(
            step=step + 1,
            running=running,
            running_scores=running_scores,
            sequences=sequences,
            scores=scores,
            finished=finished,
            lengths=lengths,
            improvable=improvable,
            all_stopped=jnp.all(stops),
            cache=cache,
        )

    carry: dict[str, Any] = dict(
        step=jnp.int32(0),
        running=start_sequences,
        # Every beam starts as the same sequence: only the first may be extended at step 1.
        running_scores=jnp.zeros((batch, beams), jnp.float32).at[:, 1:].set(NOT_A_CANDIDATE),
        sequences=start_sequences,
        scores=jnp.full((batch, beams), NOT_A_CANDIDATE, jnp.float32),
        finished=jnp.zeros((batch, beams), bool),
        lengths=jnp.zeros((batch, beams), jnp.int32),
        improvable=jnp.ones(batch, bool),
        all_stopped=jnp.bool_(False),
        cache=decoder.init_cache(length),
    )
    carry = jax.lax.while_loop(unfinished, next_token, carry)
    return (
        carry["sequences"][:, :num_return].reshape(batch * num_return, length),
        carry["scores"][:, :num_return].reshape(-1),
        carry["lengths"][:, :num_return].reshape(-1),
    )
