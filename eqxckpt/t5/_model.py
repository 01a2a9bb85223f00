"""An Equinox T5 encoder-decoder (v1.0 and v1.1), one example at a time.

Weights keep Mesh TensorFlow's layout (``x @ kernel``), so a checkpoint maps
onto the modules without transposes.
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ._config import T5Config


def relative_position_bucket(
    relative_position: Int[Array, "..."], *, bidirectional: bool, num_buckets: int = 32, max_distance: int = 128
) -> Int[Array, "..."]:
    """T5's bucket of each ``key_position - query_position``.

    **Arguments:**

    - `relative_position`: integer offsets, any shape.
    - `bidirectional`: True for the encoder (half the buckets for each sign).
    - `num_buckets`, `max_distance`: as in the model's config.

    **Returns:** bucket indices of the same shape.

    ```python
    relative_position_bucket(jnp.arange(-3, 4), bidirectional=True)
    ```
    """
    relative_position = jnp.asarray(relative_position, jnp.int32)
    bucket = jnp.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (relative_position > 0).astype(jnp.int32) * num_buckets
        n = jnp.abs(relative_position)
    else:
        n = jnp.maximum(-relative_position, 0)
    max_exact = num_buckets // 2
    # The log is taken in float32, as in the original, so buckets match exactly.
    scaled = jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (scaled * (num_buckets - max_exact)).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return bucket + jnp.where(n < max_exact, n, large)


class RMSNorm(eqx.Module):
    scale: Float[Array, " d_model"]
    eps: float = eqx.field(static=True)

    def __call__(self, x: Float[Array, "... d_model"]) -> Float[Array, "... d_model"]:
        # As the reference does: the variance and its rsqrt in float32 whatever
        # the activations' dtype, applied in the wider of the two dtypes.
        wide = jnp.promote_types(x.dtype, jnp.float32)
        variance = jnp.mean(jnp.square(x.astype(wide)), axis=-1, keepdims=True)
        normed = x.astype(wide) * jax.lax.rsqrt(variance + self.eps).astype(wide)
        return normed.astype(self.scale.dtype) * self.scale


class Attention(eqx.Module):
    q: Float[Array, "d_model inner"]
    k: Float[Array, "d_model inner"]
    v: Float[Array, "d_model inner"]
    o: Float[Array, "inner d_model"]
    num_heads: int = eqx.field(static=True)

    def heads(self, x: Array, kernel: Array) -> Float[Array, "len heads d_kv"]:
        """``x @ kernel`` with the inner dimension split into heads (``h * d_kv + j``)."""
        return (x @ kernel).reshape(x.shape[0], self.num_heads, -1)

    def attend(self, q: Array, k: Array, v: Array, bias: Float[Array, "heads q k"]) -> Array:
        """Attention of per-head queries over per-head keys and values, then the output projection."""
        scores = jnp.einsum("qhd,khd->hqk", q, k) + bias  # T5 does not scale by 1/sqrt(d_kv)
        weights = jax.nn.softmax(scores.astype(jnp.promote_types(scores.dtype, jnp.float32)), axis=-1).astype(v.dtype)
        return jnp.einsum("hqk,khd->qhd", weights, v).reshape(q.shape[0], -1) @ self.o

    def attend_cached(self, q: Array, keys: Array, values: Array, bias: Array) -> Array:
        """`attend` for rows of one query each, over cached keys and values.

        ``q`` is ``[rows, heads, d_kv]``; ``keys`` ``[rows, heads, d_kv, len]`` and
        ``values`` ``[rows, heads, len, d_kv]``: the layouts the two products read
        directly, so no step copies the cache; ``bias`` broadcasts to ``[rows, heads, len]``.
        """
        scores = jnp.einsum("rhd,rhdk->rhk", q, keys) + bias
        weights = jax.nn.softmax(scores.astype(jnp.promote_types(scores.dtype, jnp.float32)), axis=-1)
        return jnp.einsum("rhk,rhkd->rhd", weights.astype(values.dtype), values).reshape(q.shape[0], -1) @ self.o

    def __call__(self, x: Array, memory: Array, bias: Float[Array, "heads q k"]) -> Array:
        return self.attend(self.heads(x, self.q), self.heads(memory, self.k), self.heads(memory, self.v), bias)


class FeedForward(eqx.Module):
    wi_0: Float[Array, "d_model d_ff"]
    wi_1: Float[Array, "d_model d_ff"] | None  # the gate of v1.1's gated GELU; None in v1.0
    wo: Float[Array, "d_ff d_model"]

    def __call__(self, x: Array) -> Array:
        if self.wi_1 is None:
            return jax.nn.relu(x @ self.wi_0) @ self.wo
        return (jax.nn.gelu(x @ self.wi_0, approximate=True) * (x @ self.wi_1)) @ self.wo


class Block(eqx.Module):
    relative_attention_bias: Float[Array, "heads buckets"] | None  # only with per-layer biases
    self_attention_norm: RMSNorm
    self_attention: Attention
    cross_attention_norm: RMSNorm | None  # decoder blocks only
    cross_attention: Attention | None
    feed_forward_norm: RMSNorm
    feed_forward: FeedForward

    def __call__(self, x: Array, self_bias: Array, memory: Array | None = None, cross_bias: Array | None = None):
        h = self.self_attention_norm(x)
        x = x + self.self_attention(h, h, self_bias)
        if self.cross_attention is not None:
            assert self.cross_attention_norm is not None and memory is not None and cross_bias is not None
            x = x + self.cross_attention(self.cross_attention_norm(x), memory, cross_bias)
        return x + self.feed_forward(self.feed_forward_norm(x))

    def step(
        self,
        x: Array,
        self_bias: Array,
        cache: "KeyValues",
        position: Array,
        cross: "KeyValues",
        cross_bias: Array,
        layer: Array | None = None,
    ) -> tuple[Array, "KeyValues"]:
        """One decoder position for a batch of rows (``x`` is ``[rows, d_model]``): its keys
        and values written into ``cache`` at ``position`` (in place), then attention over
        the cache (``self_bias`` masks what is not written yet).

        With ``layer``, this is that layer of a scanned stack, and ``cache`` and ``cross``
        are the whole stack's (``[rows, layers, ...]``): the new position is written into
        the stacked buffer itself, so no step copies a layer's cache back into it."""
        attention = self.self_attention
        h = self.self_attention_norm(x)
        cache = (
            _write(cache[0], attention.heads(h, attention.k)[..., None], -1, position, layer),
            _write(cache[1], attention.heads(h, attention.v)[:, :, None, :], -2, position, layer),
        )
        keys, values = (_layer(kv, layer) for kv in cache)
        x = x + attention.attend_cached(attention.heads(h, attention.q), keys, values, self_bias)
        if self.cross_attention is not None:
            assert self.cross_attention_norm is not None
            h = self.cross_attention_norm(x)
            cross_keys, cross_values = (_layer(kv, layer) for kv in cross)
            x = x + self.cross_attention.attend_cached(
                self.cross_attention.heads(h, self.cross_attention.q), cross_keys, cross_values, cross_bias
            )
        return x + self.feed_forward(self.feed_forward_norm(x)), cache


def _write(buffer: Array, new: Array, axis: int, position: Array, layer: Array | None) -> Array:
    """``buffer`` with one position's keys ``[rows, heads, d_kv, 1]`` (or values ``[rows,
    heads, 1, d_kv]``) written at ``position`` of ``axis``; into layer ``layer`` of a
    stacked buffer (``[rows, layers, ...]``) when given."""
    zero = jnp.zeros((), jnp.int32)
    starts = [zero] * new.ndim
    starts[axis] = jnp.asarray(position, jnp.int32)
    if layer is not None:
        new, starts = new[:, None], [zero, jnp.asarray(layer, jnp.int32), *starts[1:]]
    return jax.lax.dynamic_update_slice(buffer, new, starts)


def _layer(stacked: Array, layer: Array | None) -> Array:
    """Layer ``layer`` of a stacked ``[rows, layers, ...]`` buffer (the buffer itself without one)."""
    return stacked if layer is None else jax.lax.dynamic_index_in_dim(stacked, layer, axis=1, keepdims=False)


# One block's keys ``[heads, d_kv, length]`` and values ``[heads, length, d_kv]`` (with a
# leading ``rows`` axis when batched).
KeyValues = tuple[Array, Array]
# A decoder's cache: per block, or, for a scanned T5, every block's stacked in one pair
# (``[layers, heads, ...]``, after ``rows`` when batched).
Cache = list[KeyValues] | KeyValues


class BlockStack(eqx.Module):
    # Per layer, a list of blocks; scanned, one block whose arrays have a leading layer axis.
    blocks: list[Block] | Block
    relative_attention_bias: Float[Array, "heads buckets"] | None  # shared by every block (None: per block)
    final_norm: RMSNorm
    causal: bool = eqx.field(static=True)
    max_distance: int = eqx.field(static=True)

    @property
    def layers(self) -> int:
        """How many blocks the stack has, in either layout."""
        if isinstance(self.blocks, Block):
            return self.blocks.feed_forward.wo.shape[0]
        return len(self.blocks)

    def position_bias(self, table: Array, length: int, queries: Array | None = None) -> Array:
        """``[heads, q, k]`` biases of ``table`` for ``queries`` (positions; default all
        ``length`` of them) attending to ``length`` keys."""
        queries = jnp.arange(length) if queries is None else queries
        relative = jnp.arange(length)[None, :] - queries[:, None]  # key - query
        buckets = relative_position_bucket(
            relative, bidirectional=not self.causal, num_buckets=table.shape[1], max_distance=self.max_distance
        )
        return table[:, buckets]

    def __call__(self, x: Array, self_mask: Array, memory: Array | None = None, cross_mask: Array | None = None):
        mask = _mask_bias(self_mask, x.dtype)
        shared = (
            None
            if self.relative_attention_bias is None
            else self.position_bias(self.relative_attention_bias, x.shape[0]) + mask
        )
        cross_bias = None if memory is None or cross_mask is None else _mask_bias(cross_mask, x.dtype)

        def run(block: Block, x: Array) -> Array:
            own = block.relative_attention_bias
            self_bias = shared if own is None else self.position_bias(own, x.shape[0]) + mask
            assert self_bias is not None  # a table per block, or one shared by the stack
            return block(x, self_bias, memory, cross_bias)

        if isinstance(self.blocks, Block):
            weights, static = eqx.partition(self.blocks, eqx.is_array)
            x, _ = jax.lax.scan(lambda x, w: (run(eqx.combine(w, static), x), None), x, weights)
        else:
            for block in self.blocks:
                x = run(block, x)
        return self.final_norm(x)

    def step(self, x: Array, position: Array, cache: Cache, cross: Cache, cross_mask: Array) -> tuple[Array, Cache]:
        """The causal stack at one position for a batch of rows, each block's keys and values cached."""
        length = jax.tree_util.tree_leaves(cache)[0].shape[-1]  # keys end with the positions
        mask = _mask_bias(jnp.arange(length) <= position, x.dtype)
        queries = jnp.reshape(position, (1,))

        def bias(table: Array) -> Array:
            return jnp.swapaxes(self.position_bias(table, length, queries), 0, 1) + mask  # [1, heads, length]

        shared = None if self.relative_attention_bias is None else bias(self.relative_attention_bias)
        cross_bias = _mask_bias(cross_mask, x.dtype)[:, None, :]

        def run(block: Block, x: Array, kv: KeyValues, cross_kv: KeyValues, index: Array | None = None):
            own = block.relative_attention_bias
            self_bias = bias(own) if own is not None else shared
            assert self_bias is not None  # a table per block, or one shared by the stack
            return block.step(x, self_bias, kv, position, cross_kv, cross_bias, index)

        if isinstance(self.blocks, Block):
            assert isinstance(cache, tuple) and isinstance(cross, tuple)
            weights, static = eqx.partition(self.blocks, eqx.is_array)

            # The stacked cache rides in the carry, so each layer writes its position in place.
            def scanned(carry: tuple[Array, KeyValues], xs: tuple[Block, Array]):
                x, kv = carry
                w, index = xs
                return run(eqx.combine(w, static), x, kv, cross, index), None

            (x, cache), _ = jax.lax.scan(scanned, (x, cache), (weights, jnp.arange(self.layers)))
            return self.final_norm(x), cache
        assert isinstance(cache, list) and isinstance(cross, list)
        written = []
        for block, kv, cross_kv in zip(self.blocks, cache, cross):
            x, kv = run(block, x, kv, cross_kv)
            written.append(kv)
        return self.final_norm(x), written


def _cross_mask(memory: Array, attention_mask: Array | None) -> Array:
    """``[1, seq]``: which encoder positions the decoder may attend to."""
    return jnp.ones((1, memory.shape[0]), bool) if attention_mask is None else attention_mask.astype(bool)[None, :]


def _mask_bias(mask: Array, dtype) -> Array:
    """0 where attention is allowed, the most negative number where it is not."""
    return jnp.where(mask, 0.0, jnp.finfo(jnp.promote_types(dtype, jnp.float32)).min).astype(
        jnp.promote_types(dtype, jnp.float32)
    )


class T5(eqx.Module):
    """T5 encoder-decoder on one example; `jax.vmap` it over a batch.

    **Arguments:**

    - `config`: the hyperparameters.
    - `key`: the PRNG key the random weights are drawn from.
    - `dtype`: the weights' dtype.
    - `scan_layers`: False (the default) keeps a list of blocks per stack
      (``encoder/blocks/3/self_attention/q``); True stacks each stack's blocks into
      one block whose arrays have a leading layer axis
      (``encoder/blocks/self_attention/q``, ``[layers, d_model, inner]``), run with
      `jax.lax.scan`: it compiles in nearly the same time at any depth, and
      computes the same outputs from the same ``key``. `eqxckpt.t5.scan` and
      `eqxckpt.t5.unscan` turn one layout into the other.

    ```python
    config = T5Config(vocab_size=512, d_model=32, num_heads=2, d_ff=64, num_layers=2)
    model = T5(config, key=jax.random.key(0))
    logits = jax.vmap(model)(input_ids, decoder_input_ids, attention_mask=mask)
    scanned = T5(config, key=jax.random.key(0), scan_layers=True)
    scanned.encoder.blocks.self_attention.q.shape  # (2, 32, 128)
    ```
    """

    shared: Float[Array, "vocab d_model"]
    encoder: BlockStack
    decoder: BlockStack
    logits_kernel: Float[Array, "d_model vocab"] | None  # None: tied to `shared` (v1.0)
    config: T5Config = eqx.field(static=True)

    def __init__(self, config: T5Config, *, key: jax.Array, dtype=jnp.float32, scan_layers: bool = False):
        keys = iter(jax.random.split(key, 64 + 16 * (config.num_layers + config.decoder_layers)))
        inner = config.num_heads * config.d_kv

        def normal(shape, scale=1.0):
            return (jax.random.normal(next(keys), shape) * scale).astype(dtype)

        def norm():
            return RMSNorm(jnp.ones(config.d_model, dtype), config.layer_norm_epsilon)

        def attention():
            d = config.d_model
            return Attention(
                normal((d, inner), d**-0.5),
                normal((d, inner), d**-0.5),
                normal((d, inner), d**-0.5),
                normal((inner, d), inner**-0.5),
                config.num_heads,
            )

        def block(cross: bool) -> Block:
            d, f = config.d_model, config.d_ff
            ffn = FeedForward(
                normal((d, f), d**-0.5), normal((d, f), d**-0.5) if config.gated else None, normal((f, d), f**-0.5)
            )
            own = bias() if config.relative_attention_per_layer else None
            return Block(
                own, norm(), attention(), norm() if cross else None, attention() if cross else None, norm(), ffn
            )

        def bias():
            return normal((config.num_heads, config.relative_attention_num_buckets), 0.1)

        def stack(layers: int, causal: bool) -> BlockStack:
            shared = None if config.relative_attention_per_layer else bias()
            # Drawn per block either way, so that both layouts of one key hold the same weights.
            blocks = [block(causal) for _ in range(layers)]
            return BlockStack(
                stacked_blocks(blocks) if scan_layers else blocks,
                shared,
                norm(),
                causal,
                config.relative_attention_max_distance,
            )

        self.config = config
        self.shared = normal((config.vocab_size, config.d_model))
        self.encoder = stack(config.num_layers, causal=False)
        self.decoder = stack(config.decoder_layers, causal=True)
        self.logits_kernel = (
            None if config.tie_word_embeddings else normal((config.d_model, config.vocab_size), config.d_model**-0.5)
        )

    @property
    def scan_layers(self) -> bool:
        """Whether the blocks are stacked and run with `jax.lax.scan` (see `T5`).

        **Returns:** True for a scanned T5, False for one with a list of blocks (or, built
        by hand, one stack of each: `scan` and `unscan` make either whole).

        ```python
        eqxckpt.t5.scan(model).scan_layers  # True
        ```
        """
        return isinstance(self.encoder.blocks, Block) and isinstance(self.decoder.blocks, Block)

    def encode(self, input_ids: Int[Array, " seq"], *, attention_mask: Int[Array, " seq"] | None = None) -> Array:
        """Encoder output after its final norm.

        **Arguments:**

        - `input_ids`: token ids ``[seq]``.
        - `attention_mask`: 1 where a token is real, 0 for padding (None: all real).

        **Returns:** ``[seq, d_model]``.

        ```python
        memory = model.encode(input_ids, attention_mask=mask)
        ```
        """
        mask = jnp.ones(input_ids.shape, bool) if attention_mask is None else attention_mask.astype(bool)
        return self.encoder(self.shared[input_ids], mask[None, :])

    def decode(
        self, decoder_input_ids: Int[Array, " dec"], memory: Array, attention_mask: Array | None = None
    ) -> Array:
        """Decoder logits given the encoder output, teacher-forced.

        **Arguments:**

        - `decoder_input_ids`: ``[dec]``, starting with the decoder start token.
        - `memory`: the encoder output ``[seq, d_model]`` (from `encode`).
        - `attention_mask`: the encoder's mask ``[seq]`` (None: all real).

        **Returns:** logits ``[dec, vocab]``.

        ```python
        logits = model.decode(decoder_input_ids, model.encode(input_ids))
        ```
        """
        return self.logits(self.decode_hidden(decoder_input_ids, memory, attention_mask))

    def decode_hidden(
        self, decoder_input_ids: Int[Array, " dec"], memory: Array, attention_mask: Array | None = None
    ) -> Float[Array, "dec d_model"]:
        """The decoder's output before the output layer, teacher-forced.

        **Arguments:**

        - `decoder_input_ids`, `memory`, `attention_mask`: as for `decode`.

        **Returns:** ``[dec, d_model]``.

        ```python
        hidden = model.decode_hidden(decoder_input_ids, model.encode(input_ids))
        ```
        """
        length = decoder_input_ids.shape[0]
        causal = jnp.tril(jnp.ones((length, length), bool))
        return self.decoder(self.shared[decoder_input_ids], causal, memory, _cross_mask(memory, attention_mask))

    def logits(self, hidden: Float[Array, "... d_model"]) -> Float[Array, "... vocab"]:
        """The output layer: tied to the embedding (scaled by ``d_model**-0.5``) or its own kernel.

        **Arguments:**

        - `hidden`: decoder outputs ``[..., d_model]``.

        **Returns:** logits ``[..., vocab]``.

        ```python
        logits = model.logits(model.decode_hidden(decoder_input_ids, memory))
        ```
        """
        if self.logits_kernel is None:
            return (hidden * self.config.d_model**-0.5) @ self.shared.T
        return hidden @ self.logits_kernel

    def init_cache(self, length: int) -> Cache:
        """An empty key/value cache for decoding up to ``length`` positions, for one row.

        **Arguments:**

        - `length`: the most decoder positions (the start token included).

        **Returns:** per decoder block, zero keys ``[heads, d_kv, length]`` and values
        ``[heads, length, d_kv]``; for a scanned T5, one pair stacked over the blocks
        (``[layers, heads, d_kv, length]`` and ``[layers, heads, length, d_kv]``).
        Broadcast them over the rows `decode_step` decodes, as a leading axis in
        either layout.

        ```python
        cache = jax.tree.map(lambda x: jnp.broadcast_to(x, (rows, *x.shape)), model.init_cache(17))
        ```
        """
        heads, d_kv, dtype = self.config.num_heads, self.config.d_kv, self.shared.dtype
        layers = self.decoder.layers
        if isinstance(self.decoder.blocks, Block):  # the decoder's layout decides the cache's
            return (jnp.zeros((layers, heads, d_kv, length), dtype), jnp.zeros((layers, heads, length, d_kv), dtype))
        return [
            (jnp.zeros((heads, d_kv, length), dtype), jnp.zeros((heads, length, d_kv), dtype)) for _ in range(layers)
        ]

    def cross_cache(self, memory: Float[Array, "seq d_model"]) -> Cache:
        """Each decoder block's cross-attention keys and values of one encoder output, computed once.

        **Arguments:**

        - `memory`: the encoder output ``[seq, d_model]``.

        **Returns:** per decoder block, keys ``[heads, d_kv, seq]`` and values ``[heads, seq, d_kv]``;
        for a scanned T5, one pair stacked over the blocks (``[layers, heads, d_kv, seq]``
        and ``[layers, heads, seq, d_kv]``).

        ```python
        cross = jax.vmap(model.cross_cache)(memory)  # a batch of rows
        ```
        """

        def keys_values(a: Attention | None) -> KeyValues:
            assert a is not None  # decoder blocks attend to the encoder
            return jnp.transpose(a.heads(memory, a.k), (1, 2, 0)), jnp.transpose(a.heads(memory, a.v), (1, 0, 2))

        blocks = self.decoder.blocks
        if isinstance(blocks, Block):
            return eqx.filter_vmap(keys_values)(blocks.cross_attention)
        return [keys_values(block.cross_attention) for block in blocks]

    def decode_step(
        self,
        tokens: Int[Array, " rows"],
        position: Int[Array, ""],
        cache: Cache,
        cross: Cache,
        attention_mask: Int[Array, "rows seq"] | None = None,
    ) -> tuple[Float[Array, "rows vocab"], Cache]:
        """The next token's logits for a batch of rows from one decoder position, with a
        key/value cache: each step costs the same whatever came before.

        Unlike the rest of the model this takes a batch (no `jax.vmap`), so the
        cache is written in place. A scanned T5 runs its blocks with `jax.lax.scan`
        over its stacked cache (``[rows, layers, ...]``), writing each block's
        position into it in place too.

        **Arguments:**

        - `tokens`: each row's decoder input at ``position`` (the start token at 0).
        - `position`: the position, from 0, the same for every row.
        - `cache`: `init_cache` broadcast over the rows, holding ``0 .. position - 1``.
        - `cross`: `cross_cache` of each row's encoder output (``jax.vmap``).
        - `attention_mask`: the encoder's mask ``[rows, seq]`` (None: all real).

        **Returns:** the logits ``[rows, vocab]`` and the cache with ``position`` written.

        ```python
        logits, cache = model.decode_step(jnp.zeros(rows, int), jnp.array(0), cache, cross, mask)
        ```
        """
        rows, seq = tokens.shape[0], jax.tree_util.tree_leaves(cross)[0].shape[-1]  # keys end with seq
        mask = jnp.ones((rows, seq), bool) if attention_mask is None else attention_mask.astype(bool)
        hidden, cache = self.decoder.step(self.shared[tokens], position, cache, cross, mask)
        return self.logits(hidden), cache

    def __call__(
        self,
        input_ids: Int[Array, " seq"],
        decoder_input_ids: Int[Array, " dec"],
        *,
        attention_mask: Int[Array, " seq"] | None = None,
    ) -> Float[Array, "dec vocab"]:
        """Logits for one example: `encode`, then `decode`.

        **Arguments:**

        - `input_ids`: encoder token ids ``[seq]``.
        - `decoder_input_ids`: ``[dec]``, starting with the decoder start token.
        - `attention_mask`: 1 where an encoder token is real (None: all real).

        **Returns:** logits ``[dec, vocab]``.

        ```python
        logits = jax.vmap(model)(input_ids, decoder_input_ids)  # a batch
        ```
        """
        return self.decode(decoder_input_ids, self.encode(input_ids, attention_mask=attention_mask), attention_mask)


def stacked_blocks(blocks: list[Block]) -> Block:
    """One block whose every array stacks the blocks' (a leading layer axis)."""
    return jax.tree_util.tree_map(lambda *layers: jnp.stack(layers), *blocks)
