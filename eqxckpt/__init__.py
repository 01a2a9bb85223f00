"""eqxckpt: Equinox-native, path-aware checkpoints for JAX.

```python
import eqxckpt
eqxckpt.save("ckpt/step_100", {"model": model, "opt_state": opt_state})
model = eqxckpt.load("ckpt/step_100", like=model_skeleton, at="model")
```
"""

__version__ = "0.1.0"

from ._checkpoint import Checkpoint as Checkpoint, LazyArray as LazyArray, open as open
from ._errors import (
    CheckpointBusyError as CheckpointBusyError,
    CheckpointChangedError as CheckpointChangedError,
    CastError as CastError,
    CheckpointError as CheckpointError,
    CheckpointExistsError as CheckpointExistsError,
    CheckpointNotFoundError as CheckpointNotFoundError,
    CheckpointWriteError as CheckpointWriteError,
    CorruptCheckpointError as CorruptCheckpointError,
    IncompleteCheckpointError as IncompleteCheckpointError,
    ManifestError as ManifestError,
    PathError as PathError,
    StructureMismatchError as StructureMismatchError,
    UnsupportedLeafError as UnsupportedLeafError,
)
from ._load import load as load
from ._manager import CheckpointManager as CheckpointManager
from ._save import SaveHandle as SaveHandle, save as save
from ._transform import Transform as Transform, TransformError as TransformError, apply_transformations as apply_transformations
from ._translate import CheckpointTranslator as CheckpointTranslator
from ._verify import VerifyReport as VerifyReport, verify as verify
