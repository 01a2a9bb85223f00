"""`open` and `Checkpoint`: a read-only, lazy view of a committed eqxckpt checkpoint."""

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._distributed import process_count, process_index
from .._errors import CheckpointError
from .._leaf import StoredLeaf
from .._storage import CheckpointPath, Storage
from .._stored import StoredArrays
from ._source import Boxes, Source


class Checkpoint(Source):
    """A committed checkpoint: its leaves, their shapes and dtypes, and metadata.

    Nothing is read from the arrays until you ask for values.

    **Attributes:** as a `Source`'s; `location` is the path or URL it was opened at,
    and `stored` owns its stored arrays (its storage backend is ``stored.storage``).

    ```python
    ckpt = eqxckpt.open("checkpoints/step_100")
    ckpt.paths                      # ['model/layers/0/weight', ...]
    ckpt.metadata["step"]           # 100
    w = ckpt["model/layers/0/weight"]  # LazyArray: shape and dtype, no data yet
    w.get()                         # numpy array
    ```
    """

    def __init__(self, stored: StoredArrays, per_process: bool = False):
        self.per_process = per_process
        self.location = stored.location
        self.stored = stored
        self.metadata = stored.manifest.metadata
        self._leaves = stored.records

    def consistent(self) -> contextlib.AbstractContextManager[None]:
        return self.stored.consistent()

    def held(self) -> contextlib.AbstractContextManager[None]:
        return self.stored.held()

    def check_unchanged(self) -> None:
        self.stored.check_unchanged()

    def _fetch(
        self, leaves: Sequence[StoredLeaf], done: Callable[[int, np.ndarray], None], reserve: Callable[[int], None]
    ) -> None:
        self.stored.fetch(leaves, done, reserve)

    def chunk_shapes(self, leaves: Sequence[StoredLeaf]) -> list[tuple[int, ...] | None]:
        """The chunks of a leaf with its own array, their layouts read and checked at once
        (`StoredArrays.prepare_layouts`) and kept for its later reads; a packed leaf is
        small, and read whole."""
        self.stored.prepare_layouts(leaves)
        return [self.stored.layout(leaf).chunk if leaf.offset is None else None for leaf in leaves]

    def _read_boxes(self, leaf: StoredLeaf, boxes: Boxes, window: int) -> None:
        """Every chunk the boxes need, read once (checksum checked) and copied into each
        (`StoredArrays.read_boxes`); one box straight from its chunks (`read_box`)."""
        if leaf.offset is not None:  # packed: small, read whole
            return super()._read_boxes(leaf, boxes, window)
        layout = self.stored.layout(leaf)
        if len(boxes) == 1:
            self.stored.read_box(leaf, boxes[0][0], boxes[0][1], layout)
        else:
            self.stored.read_boxes(leaf, layout, boxes, window)

    def identity(self) -> str | None:
        """The save that wrote this checkpoint (its manifest's ``save_id``)."""
        return self.stored.manifest.save_id

    def process_state(self, process: int | None = None) -> Any:
        """The state a process saved with this checkpoint (`eqxckpt.save`'s
        ``process_state``), as it was given: bytes, or the JSON value (a Grain
        iterator's ``get_state()``).

        **Arguments:**

        - `process`: whose state: a process index of the job that saved it. None (the
          default): this process's own, in a job of as many processes as saved it (else
          an error says to choose).

        **Returns:** the state; `CheckpointError` if that process saved none.

        ```python
        iterator.set_state(eqxckpt.open("checkpoints/step_100").process_state())
        ```
        """
        states = self.stored.manifest.process_states
        if states is None:
            raise CheckpointError(f"{self.location} was saved without a process_state.")
        return states.value(process, process_index(), process_count(), str(self.location))


def open_checkpoint(path: CheckpointPath | Storage, per_process: bool = False) -> Checkpoint:
    """An eqxckpt checkpoint, opened read-only without reading any array (`eqxckpt.open` for
    this format); ``per_process``: one process's own (`Source.per_process`)."""
    return Checkpoint(StoredArrays.open(path), per_process)
