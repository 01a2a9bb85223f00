"""What a safetensors file and HuggingFace's sharded directory are, byte for byte: the
dtype names, the header in the order the `safetensors` library writes it (`file_header`),
and how a state dict is split into shards (`split`: `huggingface_hub`'s rule) and named
(`shard_names`, `index_document`). The reader (`_read`) and the writer (`_write`) share it."""

import dataclasses
import json
import math

import numpy as np

from ..._errors import ArgumentError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# The safetensors library refuses headers over 100 MB; so does this reader.
MAX_HEADER_BYTES = 100_000_000
MAX_INDEX_BYTES = 64 * 1024 * 1024
# What one tensor costs in memory from opening a file to loading it (measured: about
# 1.5 KiB for a float32[1] tensor), so that a header is refused before it is parsed
# when reading it would take more than MAX_PARSE_FACTOR times its size.
LOAD_BYTES_PER_TENSOR = 1600
DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
}
# Types safetensors packs several to a byte; eqxckpt holds one element a byte and reads
# none of them (MXFP4 checkpoints ship their blocks as U8, which it reads).
SUB_BYTE = {"F4": "float4_e2m1fn", "F6_E2M3": "float6_e2m3fn", "F6_E3M2": "float6_e3m2fn"}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
# The library lays tensors out by dtype, in this order (its `Dtype` enum, last first),
# then by name: `tests/test_safetensors_shards.py` holds it to the library's files.
_WRITE_ORDER = [
    "U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16",
    "F8_E8M0", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL",
]  # fmt: skip
_RANK = {name: rank for rank, name in enumerate(_WRITE_ORDER)}


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a file: its name, its safetensors dtype (``"F32"``) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(DTYPES[self.dtype]).itemsize


def file_header(tensors: list[TensorEntry], metadata: dict[str, str] | None) -> tuple[bytes, list[TensorEntry]]:
    """The bytes before a file's data (the header's length, then its JSON, padded with
    spaces so the data starts 8-byte aligned) and the tensors in the order their data
    follow: what ``safetensors.numpy.save`` writes for the same tensors and metadata
    (whose keys it orders as it likes: with one key or none, byte for byte the same).

    **Arguments:**

    - `tensors`: the file's tensors, in any order.
    - `metadata`: its ``__metadata__``; None: none (``{}`` is written, as the library
      writes it).

    **Returns:** ``(head, ordered)``; the data is each of ``ordered``'s bytes in turn.

    ```python
    head, ordered = file_header([TensorEntry("w", "F32", (2, 3))], {"format": "pt"})
    ```
    """
    ordered = sorted(tensors, key=lambda t: (_RANK[t.dtype], t.name))
    doc: dict[str, object] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for tensor in ordered:
        doc[tensor.name] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    # Names as UTF-8, unescaped, as the library's serializer writes them.
    raw = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, ordered


_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}


def parse_size(size: int | str) -> int:
    """A shard limit in bytes: an int, or a string such as ``"5GB"`` read as
    `huggingface_hub` reads it (a number, then a decimal unit TB, GB, MB or KB).

    ```python
    parse_size("5GB")  # 5_000_000_000
    ```
    """
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise ArgumentError(f"max_shard_size must be a number of bytes or a string such as '5GB', got {size!r:.100}.")
    if isinstance(size, str):
        text = size.strip()
        unit = _UNITS.get(text[-2:].upper())
        try:
            value = float(text[:-2].strip()) * unit if unit is not None else math.nan
            size = int(value) if math.isfinite(value) else -1
        except ValueError:
            size = -1
        if size < 1:
            raise ArgumentError(
                f"max_shard_size {text!r:.100} is not a size of 1 byte or more such as '5GB' (units TB, GB, MB, KB)."
            )
    if size < 1:
        raise ArgumentError(f"max_shard_size must be at least 1 byte, got {size}.")
    return size


def split(sizes: list[int], max_shard_size: int) -> list[list[int]]:
    """The shards of tensors of ``sizes`` bytes (in the state dict's order), as indices:
    `huggingface_hub`'s ``split_state_dict_into_shards_factory`` rule. Tensors are taken
    in order; one that would take the current shard over the limit starts a new one; one
    over the limit on its own is a shard by itself, placed when it is met (before the
    shard being filled).

    ```python
    split([6, 6, 2, 6, 2, 2], 10)  # [[0], [1, 2], [3, 4, 5]]
    ```
    """
    shards: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, size in enumerate(sizes):
        if size > max_shard_size:
            shards.append([i])
            continue
        if filled + size > max_shard_size:
            shards.append(current)
            current, filled = [], 0
        current.append(i)
        filled += size
    if current:
        shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    """The file names of ``count`` shards: ``model-00001-of-00003.safetensors``..., or
    ``model.safetensors`` alone (no index then), as HuggingFace names them."""
    if count <= 1:
        return [SINGLE_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def index_document(files: dict[str, list[TensorEntry]], metadata: dict[str, str]) -> bytes:
    """``model.safetensors.index.json``: ``metadata`` (``total_size`` first, then the
    caller's) and the ``weight_map`` of each tensor to its file, in the state dict's
    order, as `huggingface_hub` writes it (``indent=2``)."""
    total = sum(t.nbytes for tensors in files.values() for t in tensors)
    weight_map = {t.name: name for name, tensors in files.items() for t in tensors}
    doc = {"metadata": {"total_size": total, **metadata}, "weight_map": weight_map}
    return json.dumps(doc, indent=2).encode()
