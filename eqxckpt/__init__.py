"""eqxckpt: Equinox-native, path-aware checkpoints for JAX.

```python
import eqxckpt
eqxckpt.save("ckpt/step_100", {"model": model, "opt_state": opt_state})
model = eqxckpt.load("ckpt/step_100", like=model_skeleton, at="model")
```
"""

__version__ = "0.1.0"

from ._checkpoint import Checkpoint as Checkpoint
from ._checkpoint import LazyArray as LazyArray
from ._checkpoint import open as open
from ._errors import (
    CastError as CastError,
)
from ._errors import (
    CheckpointBusyError as CheckpointBusyError,
)
from ._errors import (
    CheckpointChangedError as CheckpointChangedError,
)
from ._errors import (
    CheckpointError as CheckpointError,
)
from ._errors import (
    CheckpointExistsError as CheckpointExistsError,
)
from ._errors import (
    CheckpointNotFoundError as CheckpointNotFoundError,
)
from ._errors import (
    CheckpointWriteError as CheckpointWriteError,
)
from ._errors import (
    CorruptCheckpointError as CorruptCheckpointError,
)
from ._errors import (
    IncompleteCheckpointError as IncompleteCheckpointError,
)
from ._errors import (
    ManifestError as ManifestError,
)
from ._errors import (
    PathError as PathError,
)
from ._errors import (
    StructureMismatchError as StructureMismatchError,
)
from ._errors import (
    UnsupportedLeafError as UnsupportedLeafError,
)
from ._load import load as load
from ._manager import CheckpointManager as CheckpointManager
from ._save import SaveHandle as SaveHandle
from ._save import save as save
from ._transform import Transform as Transform
from ._transform import TransformError as TransformError
from ._transform import apply_transformations as apply_transformations
from ._translate import CheckpointTranslator as CheckpointTranslator
from ._verify import VerifyReport as VerifyReport
from ._verify import verify as verify
