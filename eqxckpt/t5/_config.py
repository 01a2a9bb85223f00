"""`T5Config`: T5 hyperparameters under HuggingFace's names, from JSON or gin."""

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from .._errors import CheckpointError, StructureMismatchError
from .._manifest import parse_json_object
from .._storage import read_capped

# config.json and operative_config.gin files are a few KiB; anything past this is not one.
MAX_CONFIG_BYTES = 4 * 1024 * 1024


# The largest value each size may take: far beyond every published T5 (XXL: d_model 4096,
# d_ff 10240, 64 heads, 24 blocks; UL2: 32 blocks; mT5: a 250,112-token vocabulary), so
# that a crafted config cannot make eqxckpt build an absurd skeleton before any check.
MAX_SIZES = {
    "vocab_size": 1 << 22,
    "d_model": 1 << 16,
    "d_kv": 1 << 12,
    "d_ff": 1 << 18,
    "num_layers": 256,
    "num_decoder_layers": 256,
    "num_heads": 1024,
    "relative_attention_num_buckets": 1 << 12,
    "relative_attention_max_distance": 1 << 20,
}


@dataclasses.dataclass(frozen=True)
class T5Config:
    """T5 hyperparameters, named as in HuggingFace's ``config.json``.

    ```python
    config = T5Config.from_dict(json.load(open("config.json")))
    config = T5Config.from_gin("operative_config.gin")
    ```
    """

    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_decoder_layers: int | None = None
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"
    tie_word_embeddings: bool = True
    # Not a HuggingFace field: some Mesh TensorFlow runs give every block its own
    # relative attention bias instead of sharing block 0's.
    relative_attention_per_layer: bool = False

    @property
    def decoder_layers(self) -> int:
        """`num_decoder_layers`, resolved: it defaults to `num_layers`.

        **Returns:** the number of decoder blocks.

        ```python
        T5Config(num_layers=8).decoder_layers  # 8
        ```
        """
        return self.num_layers if self.num_decoder_layers is None else self.num_decoder_layers

    def __post_init__(self) -> None:
        if not isinstance(self.feed_forward_proj, str) or self.feed_forward_proj not in ("relu", "gated-gelu"):
            raise CheckpointError(f"feed_forward_proj must be 'relu' or 'gated-gelu', got {self.feed_forward_proj!r}.")
        if self.num_decoder_layers is None:
            object.__setattr__(self, "num_decoder_layers", self.num_layers)
        # Configs come from files (config.json, gin): refuse what no T5 can be, by name.
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type in (int, "int", int | None, "int | None"):
                largest = MAX_SIZES[field.name]
                if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= largest:
                    shown = repr(value)
                    shown = shown if len(shown) < 40 else f"{shown[:20]}... ({len(shown)} chars)"
                    raise CheckpointError(
                        f"T5 config: {field.name} must be an integer from 1 to {largest} (no T5 is larger), "
                        f"got {shown}."
                    )
            elif field.type in (bool, "bool") and not isinstance(value, bool):
                raise CheckpointError(f"T5 config: {field.name} must be true or false, got {value!r}.")
        eps = self.layer_norm_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise CheckpointError(f"T5 config: layer_norm_epsilon must be a number in (0, 1), got {eps!r}.")

    @property
    def gated(self) -> bool:
        """Whether the feed-forward layer is v1.1's gated GELU.

        **Returns:** True for ``feed_forward_proj="gated-gelu"``.

        ```python
        T5Config(feed_forward_proj="gated-gelu").gated  # True
        ```
        """
        return self.feed_forward_proj == "gated-gelu"

    def to_dict(self) -> dict[str, Any]:
        """The config as a JSON-serialisable dict (HuggingFace's names).

        **Returns:** ``{field: value}``; `from_dict` reads it back.

        ```python
        T5Config.from_dict(config.to_dict()) == config  # True
        ```
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "T5Config":
        """From a HuggingFace ``config.json`` dict; keys it does not use are ignored.

        **Arguments:**

        - `d`: the dict (``is_gated_act``/``dense_act_fn`` are understood too).

        **Returns:** a `T5Config`.

        ```python
        T5Config.from_dict({"d_model": 512, "num_layers": 8, "feed_forward_proj": "gated-gelu"})
        ```
        """
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in d.items() if k in names}
        if (
            values.get("feed_forward_proj") == "gated-gelu"
            or d.get("is_gated_act")
            and "gelu" in str(d.get("dense_act_fn"))
        ):
            values["feed_forward_proj"] = "gated-gelu"
        return cls(**values)

    @classmethod
    def from_json(cls, path: Any) -> "T5Config":
        """From a ``config.json`` file (the dict itself, or under ``hf_t5_config``).

        **Arguments:**

        - `path`: the file.

        **Returns:** a `T5Config`.

        ```python
        config = T5Config.from_json("t5_v1_1_tiny/hf/config.json")
        ```
        """
        d = parse_json_object(read_capped(path, MAX_CONFIG_BYTES), str(path), MAX_CONFIG_BYTES)
        nested = d.get("hf_t5_config", d)
        if not isinstance(nested, dict):
            raise CheckpointError(f"{path}: 'hf_t5_config' is {type(nested).__name__}, not an object.")
        return cls.from_dict(nested)

    @classmethod
    def from_gin(cls, path: Any, **overrides: Any) -> "T5Config":
        """From a Mesh TensorFlow ``operative_config.gin`` (parsed, never executed).

        The vocabulary size is not in gin files: pass ``vocab_size=`` or let
        `load_tf` read it from the embedding's shape.

        **Arguments:**

        - `path`: the gin file.
        - `overrides`: fields to set regardless of the file (``vocab_size=32128``).

        **Returns:** a `T5Config`.

        ```python
        config = T5Config.from_gin("t5_v1_1_tiny/operative_config.gin", vocab_size=512)
        ```
        """
        raw = read_capped(path, MAX_CONFIG_BYTES)
        if len(raw) > MAX_CONFIG_BYTES:
            raise CheckpointError(f"{path} is over {MAX_CONFIG_BYTES} bytes: not an operative_config.gin.")
        bindings = parse_gin(raw.decode("utf-8", errors="replace"))

        values: dict[str, Any] = {}
        for field, keys in {
            "d_model": ("d_model", "Unitransformer.d_model"),
            "d_kv": ("d_kv", "SelfAttention.key_value_size"),
            "d_ff": ("d_ff", "DenseReluDense.hidden_size"),
            "num_heads": ("num_heads", "SelfAttention.num_heads"),
            "num_layers": ("num_layers", "encoder/make_layer_stack.num_layers"),
            "num_decoder_layers": ("decoder/make_layer_stack.num_layers",),
            "relative_attention_num_buckets": ("SelfAttention.relative_attention_num_buckets",),
            "relative_attention_max_distance": ("SelfAttention.relative_attention_max_distance",),
            "layer_norm_epsilon": ("sublayer_rms_norm.epsilon", "layer_norm.epsilon"),
        }.items():
            value = _lookup(bindings, keys)
            if value is not None:
                values[field] = value
        activation = _lookup(bindings, ("DenseReluDense.activation",))
        if activation is not None:
            values["feed_forward_proj"] = "gated-gelu" if "gelu" in str(activation) else "relu"
        tied = _lookup(bindings, ("Unitransformer.shared_embedding_and_softmax_weights",))
        if tied is not None:
            values["tie_word_embeddings"] = bool(tied)
        per_layer = _relative_attention_per_layer(bindings, path)
        if per_layer is not None:
            values["relative_attention_per_layer"] = per_layer
        values.update(overrides)
        return cls(**values)


def check_weights_fit(config: T5Config, nbytes: int, location: Any) -> None:
    """Refuse a config that describes more weights than ``nbytes`` of stored weights can
    hold (a byte each, at least): checked before a skeleton is built, so that a crafted
    config cannot make a reader build a large model for small files."""
    attention = 4 * config.d_model * config.num_heads * config.d_kv
    feed_forward = (3 if config.gated else 2) * config.d_model * config.d_ff
    embeddings = (1 if config.tie_word_embeddings else 2) * config.vocab_size * config.d_model
    blocks = config.num_layers * (attention + feed_forward) + config.decoder_layers * (2 * attention + feed_forward)
    weights = embeddings + blocks  # norms and position biases left out: a lower bound
    if nbytes < weights:
        raise StructureMismatchError(
            f"{location}: the config describes a T5 of at least {weights:,} weights, but the files hold only "
            f"{nbytes:,} bytes. Fix the config or use the matching weights.",
            mismatched=[("<model>", f"{nbytes} bytes, the config needs {weights} weights")],
        )


def weights_dtype(dtype: Any) -> Any:
    """The dtype floating weights are loaded in: None is float32 (what HuggingFace's
    ``from_pretrained`` gives, whatever the file stores), ``"auto"`` keeps the stored
    dtype (returned as None), anything else is that dtype."""
    if dtype is None:
        return np.dtype(np.float32)
    if isinstance(dtype, str) and dtype == "auto":
        return None
    try:
        return jnp.dtype(dtype)
    except TypeError:
        raise CheckpointError(
            f"dtype={dtype!r} is not a dtype; pass e.g. jnp.float32, jnp.bfloat16 or 'auto'."
        ) from None


# Mesh TensorFlow's `SelfAttention.relative_attention_type`: one table per block, or
# block 0's shared by every block of the stack.
RELATIVE_ATTENTION_TYPES = {"bias": True, "bias_shared": False}


def _relative_attention_per_layer(bindings: dict, path: Any) -> bool | None:
    """Whether the gin file gives every block its own relative attention bias (None: it does not say)."""
    found = {
        name: value
        for name, value in bindings.items()
        if name == "SelfAttention.relative_attention_type" or name.endswith("/SelfAttention.relative_attention_type")
    }
    unsupported = {
        name: value
        for name, value in found.items()
        if not isinstance(value, str) or value not in RELATIVE_ATTENTION_TYPES
    }
    if unsupported:
        raise CheckpointError(
            f"{path}: {', '.join(f'{n} = {v!r}' for n, v in unsupported.items())}; this T5 supports only "
            "relative_attention_type 'bias_shared' (T5's default) and 'bias' (one table per block)."
        )
    kinds = {RELATIVE_ATTENTION_TYPES[value] for value in found.values()}
    if len(kinds) > 1:
        raise CheckpointError(
            f"{path}: the encoder and decoder use different relative_attention_type ({found}); this T5 needs "
            "the same for both."
        )
    return kinds.pop() if kinds else None


def _lookup(bindings: dict, keys: tuple[str, ...]) -> Any:
    """The first binding whose name is one of ``keys`` or ends with ``/key``."""
    for key in keys:
        for name, value in bindings.items():
            if name == key or name.endswith("/" + key):
                return value
    return None


def parse_gin(text: str) -> dict[str, Any]:
    """``name = value`` bindings of a gin file, values as Python literals; ``%macro``
    references resolved. Only literals are understood (no code is run)."""
    raw: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        stripped = line.split("#", 1)[0].rstrip()
        if not stripped.strip() or stripped.startswith(("import ", "from ")):
            continue
        if line[:1].isspace() and current is not None:
            raw[current] += " " + stripped.strip()  # continuation of a multi-line value
            continue
        name, sep, value = stripped.partition("=")
        if sep:
            current = name.strip()
            raw[current] = value.strip()
    values = {name: _literal(value) for name, value in raw.items()}
    for name, value in values.items():
        if isinstance(value, str) and value.startswith("%"):
            values[name] = values.get(value[1:])
    return values


def _literal(text: str) -> Any:
    text = text.strip()
    if text in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[text]
    for number in (int, float):
        try:
            return number(text)
        except ValueError:
            pass
    if text[:1] in "'\"" and text[-1:] == text[:1]:
        return text[1:-1]
    if text.startswith("[") and text.endswith("]"):
        return [_literal(part) for part in text[1:-1].split(",") if part.strip()]
    return text  # a reference (@fn, %macro) or something this parser does not need
