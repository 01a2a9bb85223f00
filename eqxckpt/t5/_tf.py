"""Reading Mesh TensorFlow T5 checkpoints: `load_tf` and `convert_tf`.

TensorFlow is imported only here, lazily, and only to read the checkpoint:
each variable is read when it is needed, so memory stays near one tensor plus
what is being built.
"""

import os
import pathlib
from typing import Any

from .._errors import CheckpointError
from .._formats._tensorflow import TFCheckpoint, open_tf
from .._leaf import ArrayLeaf
from .._progress import Progress
from .._read._load import load
from .._read._translate import CheckpointTranslator, TranslatedSource
from .._storage import CheckpointPath
from ._config import T5Config
from ._import import SUBLAYERS, read_t5, write_converted
from ._model import T5

SLOT_NAMES = {"v": "v", "vr": "v_row", "vc": "v_col"}


# --- names: Mesh TensorFlow -> the T5 module's paths -----------------------------------

WEIGHTS = CheckpointTranslator()


RENAMED = {"shared/embedding": "shared", "decoder/logits/kernel": "logits_kernel"}


@WEIGHTS.add("|".join(RENAMED))
def _(opts, key, value):
    return RENAMED[key], value


@WEIGHTS.add(r"(encoder|decoder)/block_(\d+)/layer_000/SelfAttention/relative_attention_bias")
def _(opts, key, value, stack, block):
    if opts.get("per_layer"):
        return f"{stack}/blocks/{int(block)}/relative_attention_bias", value
    if int(block) != 0:
        raise CheckpointError(
            f"{key}: a relative attention bias outside block 0 means per-layer biases; "
            "pass a config with relative_attention_per_layer=True."
        )
    return f"{stack}/relative_attention_bias", value


@WEIGHTS.add(r"(encoder|decoder)/block_(\d+)/layer_(\d+)/(SelfAttention|EncDecAttention)/([qkvo])")
def _(opts, key, value, stack, block, layer, kind, name):
    sublayer = "self_attention" if kind == "SelfAttention" else "cross_attention"
    return f"{stack}/blocks/{int(block)}/{sublayer}/{name}", value


@WEIGHTS.add(r"(encoder|decoder)/block_(\d+)/layer_(\d+)/DenseReluDense/(wi|wi_0|wi_1|wo)/kernel")
def _(opts, key, value, stack, block, layer, name):
    return f"{stack}/blocks/{int(block)}/feed_forward/{'wi_0' if name == 'wi' else name}", value


@WEIGHTS.add(r"(encoder|decoder)/block_(\d+)/layer_(\d+)/(?:rms_norm|layer_norm)/scale")
def _(opts, key, value, stack, block, layer):
    sublayers = SUBLAYERS[stack]
    if int(layer) >= len(sublayers):
        return f"{stack}/blocks/{int(block)}/unknown_layer_{layer}/scale", value  # refused against the model
    return f"{stack}/blocks/{int(block)}/{sublayers[int(layer)]}_norm/scale", value


@WEIGHTS.add(r"(encoder|decoder)/(?:rms_norm|final_layer_norm)/scale")
def _(opts, key, value, stack):
    return f"{stack}/final_norm/scale", value


TRANSLATOR = CheckpointTranslator()


@TRANSLATOR.add(r"global_step")
def _(opts, key, value):
    return "step", value


@TRANSLATOR.add(r"(.+)_slot_(vr|vc|v)")
def _(opts, key, value, base, slot):
    [(path, value)] = WEIGHTS.apply({base: value}, **opts).items()
    return f"adafactor/{SLOT_NAMES[slot]}/{path}", value


@TRANSLATOR.add(r"(.+)")
def _(opts, key, value, name):
    [(path, value)] = WEIGHTS.apply({name: value}, **opts).items()
    return f"params/{path}", value


def translate(variables: TFCheckpoint, config: T5Config | None = None) -> TranslatedSource:
    """The variables under the T5 module's paths: ``params/encoder/blocks/0/...``,
    ``adafactor/v_row/...`` (the optimizer's slots) and ``step``."""
    return TRANSLATOR.apply(variables, per_layer=bool(config and config.relative_attention_per_layer))


# --- config ---------------------------------------------------------------------------


def infer_config(variables: TFCheckpoint, path: Any, config: T5Config | dict | str | None) -> T5Config:
    """The given config; else ``operative_config.gin`` beside the checkpoint, checked
    against what the variables' shapes determine; else the shapes alone."""
    if isinstance(config, T5Config):
        return config
    if isinstance(config, dict):
        return T5Config.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return T5Config.from_gin(config) if str(config).endswith(".gin") else T5Config.from_json(config)
    shapes = {path: leaf.shape for path, leaf in variables.records().items() if isinstance(leaf, ArrayLeaf)}
    found = _from_shapes(shapes)
    root = pathlib.Path(path)
    gin = (root if root.is_dir() else root.parent) / "operative_config.gin"
    if not gin.is_file():
        return T5Config(**{k: v for k, v in found.items() if v is not None})
    # Only the shapes know the vocabulary size; the gin file names the rest.
    configured = T5Config.from_gin(gin, vocab_size=found["vocab_size"])
    disagree = [
        f"{field}: {getattr(configured, field)!r} in the gin file, {value!r} from the variables' shapes"
        for field, value in found.items()
        if value is not None and getattr(configured, field) != value
    ]
    if disagree:
        raise CheckpointError(
            f"{gin} does not describe the checkpoint at {path}:\n  " + "\n  ".join(disagree) + "\n"
            "Pass config= (a T5Config, config.json or .gin) that matches the checkpoint, or move the gin file away "
            "to let the shapes decide."
        )
    return configured


def _from_shapes(shapes: dict[str, tuple]) -> dict[str, Any]:
    """The config fields the variables' shapes determine (None: they cannot tell)."""

    def need(name: str) -> tuple:
        if name not in shapes:
            raise CheckpointError(f"Cannot infer the T5 config: the checkpoint has no {name!r}. Pass config=.")
        return shapes[name]

    vocab, d_model = need("shared/embedding")
    bias = [n for n in shapes if n.endswith("SelfAttention/relative_attention_bias")]
    if not bias:
        raise CheckpointError(
            "Cannot infer num_heads: the attention kernels merge all heads and there is no relative "
            "attention bias to count them. Pass config= (a T5Config, a config.json or an operative_config.gin)."
        )
    heads, buckets = shapes[bias[0]]
    inner = need("encoder/block_000/layer_000/SelfAttention/q")[1]
    gated = "encoder/block_000/layer_001/DenseReluDense/wi_0/kernel" in shapes
    d_ff = need(f"encoder/block_000/layer_001/DenseReluDense/{'wi_0' if gated else 'wi'}/kernel")[1]

    def count(stack: str) -> int:
        return len({n.split("/")[1] for n in shapes if n.startswith(f"{stack}/block_")})

    layers, decoder_layers = count("encoder"), count("decoder")
    # A table outside block 0 means one per block; with one block per stack nothing tells.
    per_layer = any("/block_000/" not in n for n in bias) or (None if max(layers, decoder_layers) == 1 else False)
    return dict(
        vocab_size=vocab,
        d_model=d_model,
        d_kv=inner // heads,
        d_ff=d_ff,
        num_heads=heads,
        num_layers=layers,
        num_decoder_layers=decoder_layers,
        relative_attention_num_buckets=buckets,
        feed_forward_proj="gated-gelu" if gated else "relu",
        tie_word_embeddings="decoder/logits/kernel" not in shapes,
        relative_attention_per_layer=per_layer,
    )


# --- building ------------------------------------------------------------------------


def _read_model(
    translated: TranslatedSource, config: T5Config, dtype: Any, scan_layers: bool, progress: Progress = "auto"
) -> T5:
    """The model under ``params``; one error names every misfit by its TensorFlow name."""
    remedy = "Pass config= (a T5Config, config.json or .gin) that describes this checkpoint."
    return read_t5(translated, config, dtype, at="params", progress=progress, remedy=remedy, scan_layers=scan_layers)


def _open(path: Any, config: Any) -> tuple[TranslatedSource, T5Config]:
    """The translated variables and the config."""
    variables = open_tf(path)
    config = infer_config(variables, path, config)
    return translate(variables, config), config


def load_tf(
    path: str | os.PathLike[str],
    config: T5Config | dict | str | None = None,
    *,
    dtype: Any = None,
    scan_layers: bool = False,
    progress: Progress = "auto",
) -> T5:
    """A `T5` from a Mesh TensorFlow checkpoint (directory or prefix).

    The variables are read through `eqxckpt.load`, strictly: one error names
    every variable that is missing, has no place in the model, or misfits.

    **Arguments:**

    - `path`: the checkpoint's directory (with a ``checkpoint`` file) or prefix.
    - `config`: a `T5Config`, a HuggingFace config dict, or a path to a
      ``config.json`` / ``operative_config.gin``; None reads the gin file beside
      the checkpoint, else infers the config from the shapes.
    - `dtype`: the floating weights' dtype, and so the dtype the model computes
      in. None (the default) is float32, as HuggingFace's ``from_pretrained``
      gives, even though Mesh TensorFlow checkpoints store bfloat16: bfloat16
      activations are far from the reference logits. ``"auto"`` keeps the
      stored dtype; ``jnp.bfloat16`` or ``jnp.float64`` ask for those.
    - `scan_layers`: True gives a scanned T5 (see `T5`): each stack's blocks
      stacked into one block with a leading layer axis, run with `jax.lax.scan`,
      so it compiles in nearly the same time at any depth. The per-block
      variables are read straight into the stacked arrays.
    - `progress`: as for `eqxckpt.load` (True: a bar on a terminal; a callable
      receives the counts after each variable).

    **Returns:** the `T5` module.

    ```python
    model = eqxckpt.t5.load_tf("t5_v1_1_tiny/model.ckpt-100")  # float32
    logits = jax.vmap(model)(input_ids, decoder_input_ids, attention_mask=mask)
    scanned = eqxckpt.t5.load_tf("t5_v1_1_tiny", scan_layers=True)
    scanned.decoder.blocks.cross_attention.o.shape  # (2, 128, 32)
    ```
    """
    translated, config = _open(path, config)
    return _read_model(translated, config, dtype, scan_layers, progress)


def convert_tf(
    path: str | os.PathLike[str],
    out: CheckpointPath,
    config: T5Config | dict | str | None = None,
    *,
    dtype: Any = None,
    scan_layers: bool = False,
    overwrite: bool = False,
    progress: Progress = "auto",
) -> T5Config:
    """Write a Mesh TensorFlow T5 checkpoint as an eqxckpt checkpoint.

    It holds ``params`` (the `T5` module), ``step`` (``global_step``) and
    ``adafactor/{v,v_row,v_col}/<param path>`` (the optimizer's slots), with
    the config in the metadata.

    **Arguments:**

    - `path`, `config`, `dtype`, `scan_layers`, `progress`: as for `load_tf` (so
      the weights are written in float32 unless ``dtype`` says otherwise; a
      scanned T5 with its stacked arrays, and ``scan_layers`` in the metadata).
      The Adafactor slots keep the per-layer paths.
    - `out`, `overwrite`: as for `convert_hf`.

    **Returns:** the `T5Config` used.

    ```python
    config = eqxckpt.t5.convert_tf("t5_v1_1_tiny", "t5_eqx")
    converted = eqxckpt.open("t5_eqx")
    converted["step"], converted.metadata["t5_config"]["d_model"]  # (100, 32)
    ```
    """
    translated, config = _open(path, config)
    model = _read_model(translated, config, dtype, scan_layers, progress)
    slots = load(translated, at="adafactor", progress=progress) if translated.records("adafactor") else {}
    step = int(load(translated, at="step")) if "step" in translated else 0
    tree = {"params": model, "step": step, "adafactor": slots}
    return write_converted(out, tree, config, path, overwrite, progress)
