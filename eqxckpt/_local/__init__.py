"""The local tier of a `CheckpointManager`: each process's part of frequent steps on its
own host, with copies kept by peers (see `_checkpoints`)."""

from ._checkpoints import LocalCheckpoints as LocalCheckpoints, LocalChoice as LocalChoice
from ._directory import LocalTier as LocalTier, PartInfo as PartInfo
from ._peers import placement as placement
