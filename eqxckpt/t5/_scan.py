"""A T5's two layouts: per layer (a list of blocks) and scanned (one stacked block run with
`jax.lax.scan`); `scan`/`unscan` between them, how their leaves' paths correspond, and a
T5's skeleton in either."""

import operator
import re
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .._tree import flatten
from ._config import T5Config
from ._model import T5, Block, stacked_blocks

# A scanned T5's block leaves (``encoder/blocks/self_attention/q``, ``[layers, ...]``) and,
# with ``{i}`` replaced, where row i of each is in a per-layer T5 (``encoder/blocks/3/...``):
# the one statement of how the two layouts' paths correspond.
SCANNED_BLOCK_LEAF = re.compile(r"(encoder|decoder)/blocks/(?!\d)(.*)")  # not a per-layer path
PER_LAYER_BLOCK_LEAF = r"\1/blocks/{i}/\2"


def per_layer_path(path: str, layer: int) -> str:
    """Where row ``layer`` of a scanned T5's leaf at ``path`` is in a per-layer T5 (other paths
    are the same in both)."""
    match = SCANNED_BLOCK_LEAF.fullmatch(path)
    return path if match is None else match.expand(PER_LAYER_BLOCK_LEAF.replace("{i}", str(layer)))


def _unstacked(block: Block, layers: int) -> list[Block]:
    """The blocks a stacked block holds, each a row of its arrays."""
    return [jax.tree_util.tree_map(operator.itemgetter(i), block) for i in range(layers)]


def scan(model: T5) -> T5:
    """The same T5 with each stack's blocks stacked, run with `jax.lax.scan` (see `T5`).

    Copies the blocks' weights; a stack scanned already is kept as it is. To load one
    without the per-layer copy, pass ``scan_layers=True`` to `load_hf` or `load_tf`.

    **Arguments:**

    - `model`: a `T5`.

    **Returns:** a `T5` with `T5.scan_layers` True and the same outputs.

    ```python
    scanned = eqxckpt.t5.scan(model)
    scanned.decoder.blocks.feed_forward.wo.shape  # (2, 64, 32)
    ```
    """
    if model.scan_layers:
        return model
    stacked = tuple(
        b if isinstance(b, Block) else stacked_blocks(b) for b in (model.encoder.blocks, model.decoder.blocks)
    )
    return eqx.tree_at(lambda m: (m.encoder.blocks, m.decoder.blocks), model, stacked)


def unscan(model: T5) -> T5:
    """The same T5 with a list of blocks per stack: `scan` undone.

    **Arguments:**

    - `model`: a `T5`.

    **Returns:** a `T5` with `T5.scan_layers` False, whose parameter paths are those
    of ``T5(config, key=...)`` (``encoder/blocks/3/self_attention/q``).

    ```python
    per_layer = eqxckpt.t5.unscan(eqxckpt.t5.scan(model))
    len(per_layer.encoder.blocks)  # 2
    ```
    """
    if not any(isinstance(stack.blocks, Block) for stack in (model.encoder, model.decoder)):
        return model
    per_layer = tuple(
        _unstacked(stack.blocks, stack.layers) if isinstance(stack.blocks, Block) else stack.blocks
        for stack in (model.encoder, model.decoder)
    )
    return eqx.tree_at(lambda m: (m.encoder.blocks, m.decoder.blocks), model, per_layer)


def skeleton(
    config: T5Config, dtype: Any = jnp.float32, stored: Mapping[str, Any] | None = None, scan_layers: bool = False
) -> T5:
    """A `T5` of ``config`` made of `jax.ShapeDtypeStruct`s: no memory spent.

    **Arguments:**

    - `config`: the hyperparameters.
    - `dtype`: every weight's dtype; None keeps each weight's dtype in ``stored``.
    - `stored`: ``{parameter path: dtype}`` of the weights a checkpoint holds (for
      ``dtype=None``), under a per-layer T5's paths (a scanned leaf takes the dtype that
      holds every block's exactly, `numpy.result_type`: one stacked array holds them all).
    - `scan_layers`: the layout (see `T5`).

    **Returns:** the skeleton, for `eqxckpt.load`'s ``like``.

    ```python
    model = eqxckpt.load("t5_eqx", skeleton(config), at="params")
    ```
    """
    flat, treedef = flatten(eqx.filter_eval_shape(T5, config, key=jax.random.key(0), scan_layers=scan_layers))
    stored = stored or {}

    def weight(path: str, leaf: Any) -> Any:
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            return leaf
        if dtype is not None:
            return leaf.update(dtype=dtype)
        if per_layer_path(path, 0) == path:
            return leaf.update(dtype=stored.get(path, leaf.dtype))
        layers = [stored[p] for i in range(leaf.shape[0]) if (p := per_layer_path(path, i)) in stored]
        return leaf.update(dtype=jnp.result_type(*layers) if layers else leaf.dtype)

    return jax.tree_util.tree_unflatten(treedef, [weight(path, leaf) for path, _, leaf in flat])
