"""Reading Mesh TensorFlow T5 checkpoints: `load_tf` and `convert_tf`.

TensorFlow is imported only here, lazily, and only to read the checkpoint:
each variable is read when it is needed, so memory stays near one tensor plus
what is being built.
"""

import os
import pathlib
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._errors import CheckpointError, CheckpointNotFoundError, StructureMismatchError
from .._save import save
from .._translate import CheckpointTranslator
from .._tree import flatten
from ._config import T5Config
from ._model import T5

SLOT_NAMES = {"v": "v", "vr": "v_row", "vc": "v_col"}


class TFVariable:
    """One variable of a TensorFlow checkpoint: shape and dtype now, data on ``get()``."""

    def __init__(self, reader: Any, name: str, shape: tuple[int, ...], dtype: np.dtype):
        self.reader, self.name, self.shape, self.dtype = reader, name, tuple(shape), dtype

    def get(self) -> np.ndarray:
        return np.asarray(self.reader.get_tensor(self.name))


def open_tf(path: Any) -> dict[str, TFVariable]:
    """Every variable of a TF checkpoint (a directory with a ``checkpoint`` file, or a prefix)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter
    try:
        import tensorflow as tf
    except ImportError:
        raise CheckpointError(
            "Reading TensorFlow checkpoints needs TensorFlow, which is not installed. "
            "Install it with: pip install 'eqxckpt[tf]'"
        ) from None
    try:
        reader = tf.train.load_checkpoint(str(path))
    except (ValueError, tf.errors.OpError) as e:
        raise CheckpointNotFoundError(f"No TensorFlow checkpoint at {path}: {str(e).splitlines()[0]}") from None
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    return {name: TFVariable(reader, name, shapes[name], dtypes[name].as_numpy_dtype) for name in sorted(shapes)}


# --- names: Mesh TensorFlow -> the T5 module's paths -----------------------------------

WEIGHTS = CheckpointTranslator()
SUBLAYERS = {
    "encoder": ("self_attention", "feed_forward"),
    "decoder": ("self_attention", "cross_attention", "feed_forward"),
}


@WEIGHTS.add(r"shared/embedding")
def _(opts, key, value):
    return "shared", value


@WEIGHTS.add(r"decoder/logits/kernel")
def _(opts, key, value):
    return "logits_kernel", value


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


def translate(variables: dict[str, TFVariable], config: T5Config | None = None) -> dict[str, TFVariable]:
    """``{'params/encoder/blocks/0/...': variable, 'adafactor/v_row/...': ..., 'step': ...}``."""
    return TRANSLATOR.apply(variables, per_layer=bool(config and config.relative_attention_per_layer))


# --- config ---------------------------------------------------------------------------


def infer_config(variables: dict[str, TFVariable], path: Any, config: T5Config | dict | str | None) -> T5Config:
    """The given config; else ``operative_config.gin`` beside the checkpoint; else
    what the variables' shapes determine."""
    if isinstance(config, T5Config):
        return config
    if isinstance(config, dict):
        return T5Config.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return T5Config.from_gin(config) if str(config).endswith(".gin") else T5Config.from_json(config)
    shapes = {name: v.shape for name, v in variables.items()}
    found = _from_shapes(shapes)
    root = pathlib.Path(path)
    gin = (root if root.is_dir() else root.parent) / "operative_config.gin"
    if gin.is_file():
        return T5Config.from_gin(gin, vocab_size=found["vocab_size"])
    return T5Config(**found)


def _from_shapes(shapes: dict[str, tuple]) -> dict:
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

    return dict(
        vocab_size=vocab,
        d_model=d_model,
        d_kv=inner // heads,
        d_ff=d_ff,
        num_heads=heads,
        num_layers=count("encoder"),
        num_decoder_layers=count("decoder"),
        relative_attention_num_buckets=buckets,
        feed_forward_proj="gated-gelu" if gated else "relu",
        tie_word_embeddings="decoder/logits/kernel" not in shapes,
        relative_attention_per_layer=len(bias) > 2,
    )


# --- building ------------------------------------------------------------------------


def _skeleton(config: T5Config) -> Any:
    return eqx.filter_eval_shape(T5, config, key=jax.random.key(0))


def _check_fits(translated: dict[str, TFVariable], config: T5Config) -> tuple[Any, list, list]:
    """Every model leaf has exactly one variable of the right shape, and every variable a place."""
    flat, treedef = flatten(_skeleton(config))
    expected = {path: leaf for path, _, leaf in flat if isinstance(leaf, jax.ShapeDtypeStruct)}
    params = {k[len("params/") :]: v for k, v in translated.items() if k.startswith("params/")}
    missing = [p for p in expected if p not in params]
    unplaced = [v.name for p, v in params.items() if p not in expected]
    wrong = [
        f"{v.name}: shape {list(v.shape)}, but {config} needs {list(expected[p].shape)} at {p!r}"
        for p, v in params.items()
        if p in expected and tuple(expected[p].shape) != v.shape
    ]
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint ({len(missing)}): " + ", ".join(missing))
    if unplaced:
        problems.append(f"variables with no place in a T5 of this config ({len(unplaced)}): " + ", ".join(unplaced))
    if wrong:
        problems.append("variables whose shape does not fit the config:\n    " + "\n    ".join(wrong))
    if problems:
        raise StructureMismatchError(
            "The TensorFlow checkpoint does not match the T5 config:\n  " + "\n  ".join(problems)
        )
    return treedef, flat, params


def _cast(value: np.ndarray, dtype: Any) -> np.ndarray:
    """Floating weights (bfloat16 included) to ``dtype``; integers as they are."""
    value = np.asarray(value)
    floating = np.issubdtype(value.dtype, np.floating) or value.dtype.name == "bfloat16"
    return value.astype(dtype) if dtype is not None and floating else value


def _read_model(translated: dict[str, TFVariable], config: T5Config, dtype: Any, report: Callable[[str], None]) -> T5:
    """Check the variables fit ``config``, then read each weight once into the model."""
    treedef, flat, params = _check_fits(translated, config)
    leaves = []
    for leaf_path, _, leaf in flat:
        if isinstance(leaf, jax.ShapeDtypeStruct):
            variable = params[leaf_path]
            report(variable.name)
            leaf = jnp.asarray(_cast(variable.get(), dtype))
        leaves.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _open(path: Any, config: Any, progress: Callable[[str, int], None] | None):
    """The translated variables, the config, and a per-variable progress reporter."""
    variables = open_tf(path)
    config = infer_config(variables, path, config)
    total = len(variables)
    return (
        translate(variables, config),
        config,
        (lambda name: progress(name, total)) if progress else (lambda name: None),
    )


def load_tf(
    path: Any,
    config: T5Config | dict | str | None = None,
    *,
    dtype: Any = None,
    progress: Callable[[str, int], None] | None = None,
) -> T5:
    """A `T5` from a Mesh TensorFlow checkpoint (directory or prefix).

    `config`: a `T5Config`, a HuggingFace config dict, or a path to a
    ``config.json`` / ``operative_config.gin``; None reads the gin file beside
    the checkpoint, else infers the config from the shapes. `dtype` casts the
    floating weights (e.g. ``jnp.float32``; bfloat16 checkpoints stay bfloat16
    otherwise). `progress(name, total)` is called as each variable is read.

    ```python
    model = eqxckpt.t5.load_tf("gs-mirror/t5_v1_1_small/model.ckpt-1000000", dtype=jnp.float32)
    logits = jax.vmap(model)(input_ids, decoder_input_ids, attention_mask=mask)
    ```
    """
    translated, config, report = _open(path, config, progress)
    return _read_model(translated, config, dtype, report)


def _nest(flat: dict[str, Any]) -> dict:
    """``{'a/b': x}`` -> ``{'a': {'b': x}}``."""
    out: dict = {}
    for path, value in flat.items():
        node = out
        *parents, last = path.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def convert_tf(
    path: Any,
    out: Any,
    config: T5Config | dict | str | None = None,
    *,
    dtype: Any = None,
    overwrite: bool = False,
    progress: Callable[[str, int], None] | None = None,
) -> T5Config:
    """Write a Mesh TensorFlow T5 checkpoint as an eqxckpt checkpoint.

    It holds ``params`` (the `T5` module), ``step`` (``global_step``) and
    ``adafactor/{v,v_row,v_col}/<param path>`` (the optimizer's slots), with
    the config in the metadata. Returns the config.

    ```python
    config = eqxckpt.t5.convert_tf("mtf_ckpt/", "t5_eqx")
    model = eqxckpt.load("t5_eqx", lambda: T5(config, key=jax.random.key(0)), at="params")
    ```
    """
    translated, config, report = _open(path, config, progress)
    model = _read_model(translated, config, dtype, report)
    slots = {}
    for key, variable in translated.items():
        if key.startswith("adafactor/"):
            report(variable.name)
            slots[key[len("adafactor/") :]] = variable.get()
    step = 0
    if "step" in translated:
        report(translated["step"].name)
        step = int(translated["step"].get())
    tree = {"params": model, "step": step, "adafactor": _nest(slots)}
    save(out, tree, metadata={"t5_config": config.to_dict(), "source": str(path)}, overwrite=overwrite)
    return config
