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
    from ._background import SaveHandle as SaveHandle
    from ._checkpoint import Checkpoint as Checkpoint
    from ._diff import ChangedLeaf as ChangedLeaf, Diff as Diff, diff as diff
    from ._formats import open as open
    from ._leaf import (
        ArrayLeaf as ArrayLeaf,
        KeyLeaf as KeyLeaf,
        Leaf as Leaf,
        OpaqueLeaf as OpaqueLeaf,
        ScalarLeaf as ScalarLeaf,
        StoredLeaf as StoredLeaf,
    )
    from ._load import load as load
    from ._manager import CheckpointManager as CheckpointManager
    from ._restack import Stack as Stack, Unstack as Unstack
    from ._safetensors import save_safetensors as save_safetensors
    from ._save import save as save
    from ._source import LazyArray as LazyArray, Source as Source
    from ._storage import CheckpointPath as CheckpointPath
    from ._transform import Transform as Transform, apply_transformations as apply_transformations
    from ._translate import CheckpointTranslator as CheckpointTranslator
    from ._verify import VerifyReport as VerifyReport, verify as verify

# The names above that import JAX, each imported from its module on first use: the
# command line (`eqxckpt --help`, `eqxckpt inspect`) runs without JAX's start-up cost.
_LAZY = {
    "SaveHandle": "_background",
    "Checkpoint": "_checkpoint",
    "LazyArray": "_source",
    "Stack": "_restack",
    "Unstack": "_restack",
    "Leaf": "_leaf",
    "StoredLeaf": "_leaf",
    "ArrayLeaf": "_leaf",
    "KeyLeaf": "_leaf",
    "ScalarLeaf": "_leaf",
    "OpaqueLeaf": "_leaf",
    "ChangedLeaf": "_diff",
    "Diff": "_diff",
    "diff": "_diff",
    "open": "_formats",
    "load": "_load",
    "CheckpointManager": "_manager",
    "save_safetensors": "_safetensors",
    "save": "_save",
    "Source": "_source",
    "CheckpointPath": "_storage",
    "Transform": "_transform",
    "apply_transformations": "_transform",
    "CheckpointTranslator": "_translate",
    "VerifyReport": "_verify",
    "verify": "_verify",
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
