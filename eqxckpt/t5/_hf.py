"""HuggingFace's T5 layout: `load_hf` and `save_hf`.

A HuggingFace T5 directory holds ``config.json`` and ``model.safetensors`` (or
``model.safetensors.index.json`` and its shards). Tensors are torch ``[out, in]``
matrices, the transpose of this T5's ``x @ kernel`` layout; names follow
``encoder.block.{i}.layer.{j}.SelfAttention.q.weight``.
"""

import json
import os
import pathlib
import re
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from .._errors import (
    ArgumentError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    StructureMismatchError,
)
from .._formats._safetensors import INDEX_NAME, open_safetensors, save_safetensors
from .._progress import Progress
from .._read._translate import CheckpointTranslator, Transposed
from .._storage import CheckpointPath, fsync_path, write_file
from .._tree import flatten
from ._config import T5Config
from ._import import SUBLAYERS, read_t5, write_converted
from ._model import T5
from ._scan import SCANNED_BLOCK_LEAF, per_layer_path

ATTENTION = {"self_attention": "SelfAttention", "cross_attention": "EncDecAttention"}
# Leaves stored transposed: every matrix but the embedding.
TRANSPOSED = re.compile(r"logits_kernel|.*/relative_attention_bias|.*/(q|k|v|o|wi_0|wi_1|wo)")
# What the layout version these files follow is; HuggingFace records it in config.json.
TRANSFORMERS_VERSION = "4.57.6"
CONFIG_NAME, GENERATION_CONFIG_NAME, WEIGHTS_NAME = "config.json", "generation_config.json", "model.safetensors"


def hf_name(path: str, config: T5Config) -> str:
    """This T5's parameter path -> HuggingFace's tensor name (with ``{i}`` for the block
    of a scanned T5's stacked leaf, ``encoder/blocks/self_attention/q``)."""
    parts = path.split("/")
    if path == "shared":
        return "shared.weight"
    if path == "logits_kernel":
        return "lm_head.weight"
    stack = parts[0]
    if parts[1] == "relative_attention_bias":
        return f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    if parts[1] == "final_norm":
        return f"{stack}.final_layer_norm.weight"
    if not parts[2].isdigit():  # a scanned T5's leaf: every block's
        parts.insert(2, "{i}")
    block, sublayer = parts[2], parts[3]
    if sublayer == "relative_attention_bias":  # one table per block (relative_attention_per_layer)
        return f"{stack}.block.{block}.layer.0.SelfAttention.relative_attention_bias.weight"
    if sublayer.endswith("_norm"):
        return f"{stack}.block.{block}.layer.{SUBLAYERS[stack].index(sublayer[: -len('_norm')])}.layer_norm.weight"
    layer = SUBLAYERS[stack].index(sublayer)
    if sublayer == "feed_forward":
        name = "wi" if parts[4] == "wi_0" and not config.gated else parts[4]
        return f"{stack}.block.{block}.layer.{layer}.DenseReluDense.{name}.weight"
    return f"{stack}.block.{block}.layer.{layer}.{ATTENTION[sublayer]}.{parts[4]}.weight"


# --- HuggingFace's names -> this T5's paths (on the source's paths: dots became slashes) ---

NAMES = CheckpointTranslator()


def _placed(path: str, value: Any) -> tuple[str, Any]:
    """A T5 path and its tensor, turned as it is read where HuggingFace stores the
    transpose (`TRANSPOSED`, the one list both directions follow)."""
    return path, (Transposed(value) if TRANSPOSED.fullmatch(path) else value)


@NAMES.add(r"shared/weight")
def _(opts, key, value):
    return "shared", value


@NAMES.add(r"lm_head/weight")
def _(opts, key, value):
    return (None, value) if opts["tied"] else _placed("logits_kernel", value)  # tied: an alias, see `_check_aliases`


@NAMES.add(r"(encoder|decoder)/embed_tokens/weight")
def _(opts, key, value, stack):
    return None, value  # an alias of shared.weight, checked by `_check_aliases`


@NAMES.add(r"(encoder|decoder)/final_layer_norm/weight")
def _(opts, key, value, stack):
    return f"{stack}/final_norm/scale", value


@NAMES.add(r"(encoder|decoder)/block/(\d+)/layer/(\d+)/(\w+)/(?:(\w+)/)?weight")
def _(opts, key, value, stack, block, layer, kind, name):
    sublayers = SUBLAYERS[stack]
    sublayer = sublayers[int(layer)] if int(layer) < len(sublayers) else None
    where = f"{stack}/blocks/{int(block)}"
    if kind == "layer_norm" and name is None and sublayer is not None:
        return f"{where}/{sublayer}_norm/scale", value
    if name == "relative_attention_bias" and kind == "SelfAttention" and sublayer == "self_attention":
        per_block = opts["per_layer"] or int(block) != 0
        return _placed((where if per_block else stack) + "/relative_attention_bias", value)
    if sublayer is not None and ATTENTION.get(sublayer) == kind and name in ("q", "k", "v", "o"):
        return _placed(f"{where}/{sublayer}/{name}", value)
    if sublayer == "feed_forward" and kind == "DenseReluDense" and name in ("wi", "wi_0", "wi_1", "wo"):
        return _placed(f"{where}/feed_forward/{'wi_0' if name == 'wi' else name}", value)
    return f"{where}/unknown/{key}", value  # no place in a T5: refused by `load`, by its HuggingFace name


@NAMES.add(r"(.+)")
def _(opts, key, value, name):
    return f"unknown/{name}", value


# --- reading ------------------------------------------------------------------------------


def load_hf(
    path: str | os.PathLike[str], *, dtype: Any = None, scan_layers: bool = False, progress: Progress = "auto"
) -> T5:
    """A `T5` from a HuggingFace T5 directory (``config.json`` + safetensors).

    Reads ``model.safetensors``, or a sharded ``model.safetensors.index.json``,
    lazily: each tensor once, straight into the model. The output layer may be
    tied (v1.0: no ``lm_head.weight``) or not; ``encoder.embed_tokens`` /
    ``decoder.embed_tokens`` (and a tied ``lm_head``) that some files carry must
    equal ``shared.weight``.

    **Arguments:**

    - `path`: the directory.
    - `dtype`: the floating weights' dtype: None (the default) is float32, as
      HuggingFace's ``from_pretrained`` gives, whatever the file stores;
      ``"auto"`` keeps the stored dtype; or e.g. ``jnp.bfloat16``.
    - `scan_layers`: True gives a scanned T5 (see `T5`): each stack's blocks
      stacked into one block with a leading layer axis, run with `jax.lax.scan`,
      so it compiles in nearly the same time at any depth. The files' per-block
      tensors are read straight into the stacked arrays.
    - `progress`: as for `eqxckpt.load`.

    **Returns:** the `T5` module.

    ```python
    model = eqxckpt.t5.load_hf("t5_v1_1_tiny/hf")
    out = eqxckpt.t5.generate(model, input_ids, attention_mask, max_new_tokens=32)
    scanned = eqxckpt.t5.load_hf("t5_v1_1_tiny/hf", scan_layers=True)
    scanned.encoder.blocks.self_attention.q.shape  # (2, 32, 128)
    ```
    """
    root = pathlib.Path(path)
    config_file = root / CONFIG_NAME
    if not config_file.is_file():
        raise CheckpointNotFoundError(
            f"{root} has no {CONFIG_NAME}: a HuggingFace T5 directory holds config.json and model.safetensors."
        )
    config = T5Config.from_json(config_file)
    source = open_safetensors(root)
    _check_aliases(source, config)
    _check_block_counts(source, config)
    view = NAMES.apply(source, tied=config.tie_word_embeddings, per_layer=config.relative_attention_per_layer)
    remedy = "Fix config.json or use the weights it describes."
    return read_t5(
        view,
        config,
        dtype,
        progress=progress,
        expected_name=lambda p: hf_name(p, config),
        remedy=remedy,
        scan_layers=scan_layers,
    )


def _check_aliases(source: Any, config: T5Config) -> None:
    """Alias tensors some files carry must be the embedding itself: a file where they
    differ describes a model this T5 (and HuggingFace's) cannot hold."""
    aliases = ["encoder/embed_tokens/weight", "decoder/embed_tokens/weight"]
    if config.tie_word_embeddings:
        aliases.append("lm_head/weight")
    present = [alias for alias in aliases if alias in source]
    if not present or "shared/weight" not in source:
        return
    shared = source["shared/weight"].get()
    for alias in present:
        if not np.array_equal(source[alias].get(), shared):
            raise CheckpointError(
                f"{source.location}: {alias.replace('/', '.')} differs from shared.weight, but a T5 uses one "
                "embedding for both (and, with tie_word_embeddings, for the output layer). Fix the file or its "
                "config.json."
            )


def _check_block_counts(source: Any, config: T5Config) -> None:
    """The files hold the blocks config.json describes: one error for a count that differs,
    rather than one row per tensor of every block."""
    found = {"encoder": set(), "decoder": set()}
    for path in source.paths:
        match = re.match(r"(encoder|decoder)/block/(\d+)/", path)
        if match:
            found[match[1]].add(int(match[2]))
    for stack, wanted in (("encoder", config.num_layers), ("decoder", config.decoder_layers)):
        if len(found[stack]) != wanted:
            raise StructureMismatchError(
                f"{source.location}: config.json asks for {wanted} {stack} blocks, the weights hold "
                f"{len(found[stack])}. Fix config.json (num_layers / num_decoder_layers) or use the matching weights.",
                mismatched=[(stack, f"{len(found[stack])} blocks, config.json says {wanted}")],
            )


def is_hf_directory(path: Any) -> bool:
    """Whether ``path`` is a HuggingFace model directory (``config.json`` and safetensors weights).

    **Arguments:**

    - `path`: any path.

    **Returns:** True for a directory `load_hf` can read.

    ```python
    is_hf_directory("t5_v1_1_tiny/hf")  # True
    ```
    """
    root = pathlib.Path(path)
    return (root / CONFIG_NAME).is_file() and any((root / name).is_file() for name in (WEIGHTS_NAME, INDEX_NAME))


def convert_hf(
    path: str | os.PathLike[str],
    out: CheckpointPath,
    *,
    dtype: Any = None,
    scan_layers: bool = False,
    overwrite: bool = False,
    progress: Progress = "auto",
) -> T5Config:
    """Write a HuggingFace T5 directory as an eqxckpt checkpoint: ``params`` (the `T5`
    module), with the config and the layout (``scan_layers``) in the metadata.

    **Arguments:**

    - `path`, `dtype`, `scan_layers`, `progress`: as for `load_hf` (``progress`` also
      for the save); a scanned T5 is saved with its stacked arrays.
    - `out`: where to save the eqxckpt checkpoint (as for `eqxckpt.save`).
    - `overwrite`: replace a checkpoint already at ``out``.

    **Returns:** the `T5Config` read from ``config.json``.

    ```python
    config = eqxckpt.t5.convert_hf("t5_v1_1_tiny/hf", "t5_eqx")
    model = eqxckpt.load("t5_eqx", lambda: T5(config, key=jax.random.key(0)), at="params")
    ```
    """
    model = load_hf(path, dtype=dtype, scan_layers=scan_layers, progress=progress)
    return write_converted(out, {"params": model}, model.config, path, overwrite, progress)


# --- writing ------------------------------------------------------------------------------


def hf_config(config: T5Config, dtype: Any) -> dict[str, Any]:
    """``config.json`` for ``config``, with the keys HuggingFace transformers writes for T5."""
    return {
        "architectures": ["T5ForConditionalGeneration"],
        "classifier_dropout": 0.0,
        "d_ff": config.d_ff,
        "d_kv": config.d_kv,
        "d_model": config.d_model,
        "decoder_start_token_id": 0,
        "dense_act_fn": "gelu_new" if config.gated else "relu",
        # This T5 has no dropout; 0.0 keeps HuggingFace's forward pass the same in training.
        "dropout_rate": 0.0,
        "dtype": np.dtype(dtype).name,
        "eos_token_id": 1,
        "feed_forward_proj": config.feed_forward_proj,
        "initializer_factor": 1.0,
        "is_encoder_decoder": True,
        "is_gated_act": config.gated,
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "model_type": "t5",
        "num_decoder_layers": config.decoder_layers,
        "num_heads": config.num_heads,
        "num_layers": config.num_layers,
        "pad_token_id": 0,
        "relative_attention_max_distance": config.relative_attention_max_distance,
        "relative_attention_num_buckets": config.relative_attention_num_buckets,
        "tie_word_embeddings": config.tie_word_embeddings,
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": True,
        "vocab_size": config.vocab_size,
    }


def save_hf(
    path: str | os.PathLike[str],
    model: T5,
    *,
    max_shard_size: int | str | None = None,
    overwrite: bool = False,
    progress: Progress = "auto",
) -> None:
    """Write a `T5` as a HuggingFace T5 directory, so a model trained in Equinox can be published.

    Writes ``model.safetensors`` (HuggingFace's tensor names and ``[out, in]``
    layout, the model's dtype, metadata ``{"format": "pt"}``), then
    ``generation_config.json`` and, last, ``config.json``: each file atomically,
    so a directory with a ``config.json`` written by this call is complete.
    ``transformers``' ``T5ForConditionalGeneration.from_pretrained`` reads it.

    **Arguments:**

    - `path`: the directory (created if needed). The location comes first, as in
      `eqxckpt.save`.
    - `model`: the `T5`, per-layer or scanned (its stacked blocks are written
      as HuggingFace's per-block tensors: the same file as the per-layer T5's).
      Per-block relative attention biases are refused: HuggingFace's T5 has one
      table per stack.
    - `max_shard_size`: write the tensors as HuggingFace's shards of at most this
      many bytes (an int, or a string such as ``"5GB"``) and their index
      (`eqxckpt.save_safetensors`), not one ``model.safetensors``.
    - `overwrite`: replace the files of a model already there. Without it,
      existing files are never touched: `CheckpointExistsError`.
    - `progress`: as for `eqxckpt.save` (a bar on a terminal, or a callable).

    **Returns:** nothing.

    ```python
    eqxckpt.t5.save_hf("my-t5", model)
    model = eqxckpt.t5.load_hf("my-t5")
    ```
    """
    if not isinstance(model, T5):
        raise ArgumentError(
            f"t5.save_hf(path, model) needs a T5 as model, got {type(model).__name__}. The location comes first, "
            "as in eqxckpt.save: t5.save_hf(path, model)."
        )
    config = model.config
    if config.relative_attention_per_layer:
        raise CheckpointError(
            "This T5 has a relative attention bias per block (relative_attention_per_layer=True); HuggingFace's "
            "T5 has one per stack, so it cannot load such a model. Save it with eqxckpt.save instead."
        )
    root = pathlib.Path(path)
    names = (WEIGHTS_NAME, INDEX_NAME, GENERATION_CONFIG_NAME, CONFIG_NAME)
    existing = [name for name in names if (root / name).exists()]
    if existing and not overwrite:
        raise CheckpointExistsError(f"{root} already holds {', '.join(existing)}; pass overwrite=True to replace them.")
    # The per-layer T5's tree, each leaf as HuggingFace lays it out ([out, in]), named as
    # HuggingFace names it: save_safetensors writes it.
    tree: dict[str, Any] = {}
    for leaf_path, value in _per_layer_arrays(model):
        node = tree
        *parents, last = leaf_path.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = np.ascontiguousarray(value.T) if TRANSPOSED.fullmatch(leaf_path) else value
    root.mkdir(parents=True, exist_ok=True)
    if overwrite:  # the old config goes first (durably): until the new one is written, the directory is incomplete
        (root / CONFIG_NAME).unlink(missing_ok=True)
        fsync_path(root)
    save_safetensors(
        root if max_shard_size is not None else root / WEIGHTS_NAME,
        tree,
        max_shard_size=max_shard_size,
        names=lambda leaf_path: hf_name(leaf_path, config),
        metadata={"format": "pt"},
        overwrite=overwrite,
        progress=progress,
    )
    generation = {"decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}
    _write_json(root / GENERATION_CONFIG_NAME, {**generation, "transformers_version": TRANSFORMERS_VERSION}, overwrite)
    _write_json(root / CONFIG_NAME, hf_config(config, model.shared.dtype), overwrite)  # each file is durable


def _per_layer_arrays(model: T5) -> Iterator[tuple[str, np.ndarray]]:
    """The model's arrays under a per-layer T5's paths: a scanned T5's stacked block
    arrays are given row by row (views, not copies), as the blocks HuggingFace names."""
    for leaf_path, _, leaf in flatten(model)[0]:
        if not isinstance(leaf, jax.Array):
            continue
        value = np.asarray(leaf)
        if SCANNED_BLOCK_LEAF.fullmatch(leaf_path):  # a stacked stack's (whichever the other's layout)
            yield from ((per_layer_path(leaf_path, i), row) for i, row in enumerate(value))
        else:
            yield leaf_path, value


def _write_json(final: pathlib.Path, doc: dict[str, Any], overwrite: bool) -> None:
    write_file(final, lambda f: f.write((json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()), overwrite)
