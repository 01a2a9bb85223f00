"""eqxckpt: Equinox-native, path-aware checkpoints for JAX.

```python
import eqxckpt
eqxckpt.save("checkpoints/step_100", {"model": model, "opt_state": opt_state})
model = eqxckpt.load("checkpoints/step_100", like=model_skeleton, at="model")
```
"""

import importlib
import threading
from typing import TYPE_CHECKING, Any

from ._errors import (
    ArgumentError as ArgumentError,
    CastError as CastError,
    CheckpointBusyError as CheckpointBusyError,
    CheckpointChangedError as CheckpointChangedError,
    CheckpointError as CheckpointError,
    CheckpointExistsError as CheckpointExistsError,
    CheckpointNotFoundError as CheckpointNotFoundError,
    CheckpointWriteError as CheckpointWriteError,
    CorruptCheckpointError as CorruptCheckpointError,
    IncompleteCheckpointError as IncompleteCheckpointError,
    ManifestError as ManifestError,
    PathError as PathError,
    StructureMismatchError as StructureMismatchError,
    TransformError as TransformError,
    UnsupportedFormatError as UnsupportedFormatError,
    UnsupportedLeafError as UnsupportedLeafError,
)
from ._interrupts import interrupts_deferred
from ._version import __version__ as __version__

if TYPE_CHECKING:
    from ._check._diff import ChangedLeaf as ChangedLeaf, Diff as Diff, diff as diff
    from ._check._verify import VerifyReport as VerifyReport, verify as verify
    from ._formats._open import open as open
    from ._formats._safetensors import save_safetensors as save_safetensors
    from ._leaf import (
        ArrayLeaf as ArrayLeaf,
        KeyLeaf as KeyLeaf,
        Leaf as Leaf,
        OpaqueLeaf as OpaqueLeaf,
        ScalarLeaf as ScalarLeaf,
        StoredLeaf as StoredLeaf,
    )
    from ._read._checkpoint import Checkpoint as Checkpoint
    from ._read._lazy import LazyArray as LazyArray
    from ._read._load import load as load
    from ._read._restack import Stack as Stack, Unstack as Unstack
    from ._read._source import Source as Source
    from ._read._transform import Transform as Transform, apply_transformations as apply_transformations
    from ._read._translate import CheckpointTranslator as CheckpointTranslator
    from ._run._manager import CheckpointManager as CheckpointManager
    from ._storage import CheckpointPath as CheckpointPath
    from ._write._background import SaveHandle as SaveHandle
    from ._write._save import save as save

# The names above that import JAX, each imported from its module on first use: the
# command line (`eqxckpt --help`, `eqxckpt inspect`) runs without JAX's start-up cost.
_LAZY = {
    "SaveHandle": "_write._background",
    "Checkpoint": "_read._checkpoint",
    "LazyArray": "_read._lazy",
    "Stack": "_read._restack",
    "Unstack": "_read._restack",
    "Leaf": "_leaf",
    "StoredLeaf": "_leaf",
    "ArrayLeaf": "_leaf",
    "KeyLeaf": "_leaf",
    "ScalarLeaf": "_leaf",
    "OpaqueLeaf": "_leaf",
    "ChangedLeaf": "_check._diff",
    "Diff": "_check._diff",
    "diff": "_check._diff",
    "open": "_formats._open",
    "load": "_read._load",
    "CheckpointManager": "_run._manager",
    "save_safetensors": "_formats._safetensors",
    "save": "_write._save",
    "Source": "_read._source",
    "CheckpointPath": "_storage",
    "Transform": "_read._transform",
    "apply_transformations": "_read._transform",
    "CheckpointTranslator": "_read._translate",
    "VerifyReport": "_check._verify",
    "verify": "_check._verify",
}


# The whole API, for `from eqxckpt import *` (which then imports the lazy names too).
__all__ = [
    "ArgumentError",
    "ArrayLeaf",
    "CastError",
    "ChangedLeaf",
    "Checkpoint",
    "CheckpointBusyError",
    "CheckpointChangedError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointPath",
    "CheckpointTranslator",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "Diff",
    "IncompleteCheckpointError",
    "KeyLeaf",
    "LazyArray",
    "Leaf",
    "ManifestError",
    "OpaqueLeaf",
    "PathError",
    "SaveHandle",
    "ScalarLeaf",
    "Source",
    "Stack",
    "StoredLeaf",
    "StructureMismatchError",
    "Transform",
    "TransformError",
    "UnsupportedFormatError",
    "UnsupportedLeafError",
    "Unstack",
    "VerifyReport",
    "__version__",
    "apply_transformations",
    "diff",
    "load",
    "open",
    "save",
    "save_safetensors",
    "verify",
]

# One first import at a time: two threads importing JAX's modules at once can each
# find the other's half-initialised.
_IMPORTING = threading.RLock()


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # Ctrl-C held back meanwhile: an import of JAX cut short can crash the interpreter.
    with _IMPORTING, interrupts_deferred():
        value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})  # the API, not its tools
