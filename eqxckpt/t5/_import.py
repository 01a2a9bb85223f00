"""One import path for foreign T5 weights: a translated view (Mesh TensorFlow's or
HuggingFace's names under the `T5` module's paths) read through `eqxckpt.load`."""

from collections.abc import Callable
from typing import Any

from .._errors import StructureMismatchError
from .._leaf import ArrayLeaf
from .._progress import Progress
from .._read._load import differences, load, plan
from .._read._restack import Stack
from .._read._translate import TranslatedSource
from .._storage import CheckpointPath
from .._write._save import save
from ._config import T5Config, check_weights_fit, weights_dtype
from ._model import T5
from ._scan import PER_LAYER_BLOCK_LEAF, SCANNED_BLOCK_LEAF, skeleton

# The sub-layers of a block, in the order both formats number them.
SUBLAYERS = {
    "encoder": ("self_attention", "feed_forward"),
    "decoder": ("self_attention", "cross_attention", "feed_forward"),
}


def read_t5(
    view: TranslatedSource,
    config: T5Config,
    dtype: Any,
    *,
    at: str | None = None,
    progress: Progress = "auto",
    expected_name: Callable[[str], str] | None = None,
    remedy: str,
    scan_layers: bool = False,
) -> T5:
    """The `T5` of ``config`` from ``view`` (its parameters under ``at``, per-layer paths),
    floating weights in ``dtype`` (as `weights_dtype` reads it), in the layout ``scan_layers``
    says.

    Refuses, before reading, weights too few for ``config``; then one
    `StructureMismatchError` names every missing, unplaced or misfitting tensor,
    found ones by the format's own names, missing ones by ``expected_name``, in
    either layout.
    """
    records = view.records(at)
    check_weights_fit(config, sum(leaf.nbytes for leaf in records.values()), view.location)
    stored = {path: leaf.dtype for path, leaf in records.items() if isinstance(leaf, ArrayLeaf)}
    like = skeleton(config, weights_dtype(dtype), stored)
    try:
        if not scan_layers:
            return load(view, like, at=at, cast=True, progress=progress)
        # Planned as the per-layer T5 first (paths alone, nothing read): a load with
        # transforms drops tensors no leaf takes, and this one plan names every misfit as
        # a per-layer import does. Then each block's layers go straight into its stacked leaf.
        plan(view, like, at=at, cast=True)
        stacked = skeleton(config, weights_dtype(dtype), stored, scan_layers=True)
        transforms = {SCANNED_BLOCK_LEAF.pattern: Stack(PER_LAYER_BLOCK_LEAF)}
        return load(view, stacked, at=at, cast=True, transforms=transforms, progress=progress)
    except StructureMismatchError as e:
        missing = e.missing
        if expected_name is not None:
            missing = [(path, f"{what}, named {expected_name(path)} in the files") for path, what in missing]
        lines = [
            f"{view.location} does not hold the T5 its config describes ({config}):",
            *differences(missing, e.unexpected, e.mismatched, like="a T5 of this config"),
            remedy,
        ]
        raise StructureMismatchError(
            "\n".join(lines), missing=missing, unexpected=e.unexpected, mismatched=e.mismatched
        ) from None


def write_converted(
    out: CheckpointPath, tree: dict[str, Any], config: T5Config, source: Any, overwrite: bool, progress: Progress
) -> T5Config:
    """Save a converted T5 (``tree["params"]``) with its config, its layout and where it came
    from in the metadata."""
    params = tree["params"]
    # The layout says which skeleton loads it back: T5(config, key=..., scan_layers=...).
    metadata = {"t5_config": config.to_dict(), "source": str(source), "scan_layers": params.scan_layers}
    save(out, tree, metadata=metadata, overwrite=overwrite, progress=progress)
    return config
