"""`open`: any readable checkpoint as a `Source`, its format detected from what is at the path.

- ``eqxckpt``: a directory (or object-store prefix) with an ``eqxckpt.json``.
- ``safetensors``: a ``.safetensors`` file (or any file that starts as one does),
  a directory holding
  ``model.safetensors``, or a sharded HuggingFace directory
  (``model.safetensors.index.json`` and its shards).
- ``orbax``: a directory `orbax-checkpoint` wrote a pytree into (``_METADATA``).
- ``tf``: a TensorFlow checkpoint: a directory with a ``checkpoint`` file, or a
  prefix (``model.ckpt-1000`` beside ``model.ckpt-1000.index``). Needs
  TensorFlow (``pip install 'eqxckpt[tf]'``).

PyTorch pickles (``.bin``, ``.pt``...) are refused: reading one runs code
from the file.
"""

import pathlib
from typing import TYPE_CHECKING

from .._arguments import checked_arguments
from .._errors import CheckpointNotFoundError, UnsupportedFormatError

if TYPE_CHECKING:
    from .._read._source import Source
    from .._storage import CheckpointPath, Storage

# The readers are imported when a checkpoint is opened: the command line builds its
# arguments from FORMATS without them.

FORMATS = ("eqxckpt", "safetensors", "orbax", "tf")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle")
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


@checked_arguments
def open(path: "CheckpointPath", *, format: str | None = None) -> "Source":  # noqa: A001 - public name fixed by the design
    """Open a checkpoint read-only, without reading any array.

    **Arguments:**

    - `path`: where the checkpoint is: a local directory or file, a ``file://``,
      ``memory://``, ``s3://`` or ``gs://`` URL, or a TensorStore kvstore spec dict.
    - `format`: ``"eqxckpt"``, ``"safetensors"``, ``"orbax"`` or ``"tf"``;
      None detects it from what is at ``path``.

    **Returns:** the checkpoint (a `Checkpoint` for eqxckpt's format): its
    paths, metadata, and lazy leaves, which `eqxckpt.load` restores.

    ```python
    ckpt = eqxckpt.open("checkpoints/step_100")
    print(ckpt.paths, ckpt.metadata)
    hf = eqxckpt.open("t5_v1_1_tiny/hf/model.safetensors")  # encoder/block/0/layer/0/SelfAttention/q/weight, ...
    ```
    """
    from .._read._checkpoint import open_checkpoint
    from .._storage import resolve
    from ._orbax import OrbaxCheckpoint
    from ._safetensors import open_safetensors
    from ._tensorflow import open_tf

    if format is not None and format not in FORMATS:
        raise UnsupportedFormatError(f"Unknown format {format!r}: eqxckpt reads {', '.join(FORMATS)}.")
    storage = resolve(path)
    found = detect(storage) if format is None else format
    if found == "eqxckpt":
        return open_checkpoint(storage)
    local = storage.local
    if local is None:
        raise UnsupportedFormatError(f"{found} checkpoints are read from local paths only, not {storage}.")
    if found == "tf":
        return open_tf(local)
    return open_safetensors(local) if found == "safetensors" else OrbaxCheckpoint(local)


def detect(path: "CheckpointPath | Storage") -> str:
    """The format of what is at ``path`` (``eqxckpt`` when nothing else fits, so
    that its errors say what is missing); `UnsupportedFormatError` for a pickle."""
    from .._storage import resolve

    local = resolve(path).local
    if local is None:
        return "eqxckpt"
    try:
        return _detect_local(local)
    except OSError as e:
        raise CheckpointNotFoundError(
            f"Cannot read {e.filename or local}: {e.strerror or e}. Check its permissions (eqxckpt needs to read "
            "a checkpoint's files and list its directories)."
        ) from None


def _detect_local(local: pathlib.Path) -> str:
    from .._paths import MANIFEST_NAME
    from ._orbax import is_orbax
    from ._safetensors import INDEX_NAME, SINGLE_NAME

    if not local.exists() and local.with_name(local.name + ".index").is_file():
        return "tf"
    if local.is_file():
        if local.suffix == ".safetensors" or _starts_like_safetensors(local):
            return "safetensors"
        _refuse_pickle(local)
    elif local.is_dir() and not (local / MANIFEST_NAME).exists():
        if (local / INDEX_NAME).is_file() or (local / SINGLE_NAME).is_file():
            return "safetensors"
        if is_orbax(local):
            return "orbax"
        if (local / "checkpoint").is_file():
            return "tf"
        for name in PICKLE_FILES:
            if (local / name).exists():
                _refuse_pickle(local / name)
    return "eqxckpt"


def _refuse_pickle(file: pathlib.Path) -> None:
    if file.suffix in PICKLE_SUFFIXES or file.name in PICKLE_FILES or _starts_like_pickle(file):
        raise UnsupportedFormatError(
            f"{file} is a PyTorch pickle: reading it would run code stored in the file, which eqxckpt never "
            "does. Use the model's safetensors weights (model.safetensors) if it has them, or convert it once "
            'where you trust it: python -c "import torch, safetensors.torch as st; '
            f"st.save_file(torch.load('{file.name}', weights_only=True), 'model.safetensors')\"."
        )


def _starts_like_safetensors(file: pathlib.Path) -> bool:
    """A safetensors file whatever its name: an 8-byte little-endian header length that
    fits in the file, then the header's JSON object."""
    try:
        with file.open("rb") as f:
            head = f.read(9)
            size = file.stat().st_size
    except OSError:
        return False
    return len(head) == 9 and 2 <= int.from_bytes(head[:8], "little") <= size - 8 and head[8:9] == b"{"


def _starts_like_pickle(file: pathlib.Path) -> bool:
    try:
        with file.open("rb") as f:
            head = f.read(4)
    except OSError:
        return False
    # A pickle's protocol opcode, or the zip archive torch.save writes around one.
    return head[:1] == b"\x80" or head == b"PK\x03\x04"
