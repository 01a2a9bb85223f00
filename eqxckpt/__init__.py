"""eqxckpt: Equinox-native, path-aware checkpoints for JAX.

```python
import eqxckpt
eqxckpt.save("checkpoints/step_100", {"model": model, "opt_state": opt_state})
model = eqxckpt.load("checkpoints/step_100", like=model_skeleton, at="model")
```
"""

from ._background import SaveHandle as SaveHandle
from ._checkpoint import Checkpoint as Checkpoint
from ._diff import ChangedLeaf as ChangedLeaf, Diff as Diff, diff as diff
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
from ._formats import open as open
from ._lazy import LazyArray as LazyArray
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
from ._safetensors import save_safetensors as save_safetensors
from ._save import save as save
from ._source import Source as Source
from ._storage import CheckpointPath as CheckpointPath
from ._transform import Transform as Transform, apply_transformations as apply_transformations
from ._translate import CheckpointTranslator as CheckpointTranslator
from ._verify import VerifyReport as VerifyReport, verify as verify
from ._version import __version__ as __version__
