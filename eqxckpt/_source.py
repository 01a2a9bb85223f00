"""`Source`: the read-only interface every readable checkpoint implements.

A source is a set of named leaves (`Leaf`: path, key records, shape and dtype
for arrays) with metadata, and a way to read the stored ones. eqxckpt
checkpoints (`Checkpoint`), TensorFlow checkpoints (`eqxckpt.t5`) and
translated views of either (`CheckpointTranslator.apply`) are sources, so
`load`, `Transform` and `CheckpointTranslator` work on all of them alike.
"""

import abc
import contextlib
import difflib
import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ._budget import check_allocation
from ._errors import CheckpointChangedError, CheckpointError, ManifestError
from ._leaf import KeyRecord, Leaf, StoredLeaf
from ._paths import ancestors, depth, normalize_at, relative_to
from ._progress import advance
from ._storage import NoLock, Pin, reading
from ._tree import build_plain_tree
from ._window import start_jax


class Source(abc.ABC):
    """What `eqxckpt.open` returns for every format: a read-only, lazily read set of
    named leaves and their metadata, which `eqxckpt.load` restores.

    `Checkpoint` is the one for eqxckpt's own format; safetensors files, Orbax and
    TensorFlow checkpoints and `CheckpointTranslator` views are the others. Index
    it by leaf path for lazy leaves; `paths`, `metadata`, `records()`, `tree()`.

    ```python
    source = eqxckpt.open("model.safetensors")
    assert isinstance(source, eqxckpt.Source)
    print(source.paths[:3], source.metadata)
    ```
    """

    location: Any
    metadata: dict[str, Any]
    _leaves: dict[str, Leaf]
    # Whether the format holds arrays only (safetensors, TensorFlow): then `load` takes a
    # `like`'s other leaves (Dropout's `p` and `inference`) from `like`, as `transforms=` does.
    arrays_only: bool = False

    _pin: Pin | None = None  # what proves the source read is the one opened (None: nothing to check)

    def _read(self, wanted: Sequence[tuple[StoredLeaf, Any]]) -> list[Any]:
        """Read stored leaves, each into what its target asks for (None: as saved).

        The one read contract: this checks the memory a restore needs before it is
        allocated, names the leaf in any failure, finishes each array into its target
        (checked casts included) and reports progress; a format's source only fetches
        stored arrays (`_fetch`)."""
        start_jax()
        values: list[Any] = [None] * len(wanted)

        def done(i: int, data: np.ndarray) -> None:
            leaf, target = wanted[i]
            with reading(leaf):
                values[i] = leaf.finish(data, target)
            advance(leaf.nbytes)

        def reserve(nbytes: int) -> None:
            check_allocation(nbytes, f"Restoring {len(wanted)} leaves from {self.location}")

        self._fetch([leaf for leaf, _ in wanted], done, reserve)
        return values

    def _fetch(
        self, leaves: Sequence[StoredLeaf], done: Callable[[int, np.ndarray], None], reserve: Callable[[int], None]
    ) -> None:
        """Read each of ``leaves`` whole, as stored (its dtype, its ``data_shape``), and call
        ``done(i, data)`` for each, in any order; call ``reserve(nbytes)`` with the bytes it
        will hold before it allocates them (once the files were checked to hold them).
        Failures may be raised as they are: `_read` names the leaf."""
        raise NotImplementedError(f"{type(self).__name__} reads through another source.")

    @contextlib.contextmanager
    def consistent(self) -> Iterator[None]:
        """Reads inside come from this checkpoint alone, or raise `CheckpointChangedError`.

        On a local disk, a shared lock keeps eqxckpt's retention from deleting it
        meanwhile; afterwards (or when a read fails) the checkpoint must still be
        the one whose metadata was read: not replaced, not being deleted. Sources
        without a pin (a single open file, TensorFlow's reader) read as they are.

        **Returns:** a context manager.

        ```python
        ckpt = eqxckpt.open("ckpt")
        with ckpt.consistent():  # both from the same checkpoint, or an error
            w, b = ckpt["model/w"].get(), ckpt["model/b"].get()
        ```
        """
        with self.held():
            try:
                yield
            except CheckpointChangedError:
                raise
            except Exception as e:
                if self._pin is not None and self._pin.changed():
                    raise self._changed() from e
                raise
            self.check_unchanged()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """On a local disk, a shared lock that keeps eqxckpt's retention from deleting this
        checkpoint while the block runs. Unlike `consistent`, nothing is checked afterwards.

        **Returns:** a context manager; entering it raises `CheckpointChangedError` if the
        checkpoint is gone already.

        ```python
        with ckpt.held():  # a save taking files from ckpt holds it so
            ...
        ```
        """
        lock = self._pin.hold() if self._pin is not None else NoLock()
        if lock is None:
            raise self._changed()
        try:
            yield
        finally:
            lock.release()

    def check_unchanged(self) -> None:
        """Raise `CheckpointChangedError` if the checkpoint was replaced or deleted since it was opened.

        **Returns:** nothing; sources without a pin (a single open file) never raise.

        ```python
        ckpt.check_unchanged()  # what was read so far is this checkpoint's
        ```
        """
        if self._pin is not None and self._pin.changed():
            raise self._changed()

    def _changed(self) -> CheckpointChangedError:
        return CheckpointChangedError(
            f"The checkpoint at {self.location} was replaced or deleted by another process while it was being "
            "read, so what was read may mix two checkpoints and is discarded. Open or load it again."
        )

    def _lazy(self, leaf: StoredLeaf) -> "LazyEntry":
        """A stored leaf as a `LazyEntry`: shape and dtype now, data on ``get()``."""
        return LazyEntry(self, leaf)

    # -- description ---------------------------------------------------------------

    @property
    def paths(self) -> list[str]:
        """Every leaf path, in the order they were saved.

        **Returns:** a list of paths (``model/layers/0/weight``).

        ```python
        [p for p in ckpt.paths if p.startswith("opt_state/")]
        ```
        """
        return list(self._leaves)

    @property
    def nbytes(self) -> int:
        """Total bytes of all stored arrays.

        **Returns:** an int.

        ```python
        print(f"{ckpt.nbytes / 2**20:.1f} MiB")
        ```
        """
        return sum(leaf.nbytes for leaf in self._leaves.values())

    def leaf(self, leaf_path: str) -> Leaf:
        """The description of one leaf; a `KeyError` suggests near names.

        **Arguments:**

        - `leaf_path`: the leaf's path (``model/w``).

        **Returns:** its `Leaf`: ``kind``, ``describe()``, and for arrays ``shape`` and ``dtype``.

        ```python
        ckpt.leaf("model/w").describe()  # 'float32[4,3]'
        ```
        """
        try:
            return self._leaves[leaf_path]
        except KeyError:
            raise KeyError(
                f"No leaf {leaf_path!r} in {self.location}.{did_you_mean(leaf_path, self._leaves)}"
            ) from None

    def origin(self, leaf_path: str) -> str:
        """The name the leaf at ``leaf_path`` has in the format that stores it, so errors
        can name foreign tensors as their users know them.

        **Arguments:**

        - `leaf_path`: the leaf's path here (``encoder/block/0/layer/0/SelfAttention/q/weight``).

        **Returns:** the stored name: the path itself for eqxckpt and TensorFlow
        checkpoints, the dotted tensor name for safetensors
        (``encoder.block.0.layer.0.SelfAttention.q.weight``), and for a
        `CheckpointTranslator` view the original's name of a leaf a rule renamed
        (followed by ``(transposed)`` where the rule transposed it).

        ```python
        eqxckpt.open("model.safetensors").origin("encoder/proj/weight")  # 'encoder.proj.weight'
        ```
        """
        self.leaf(leaf_path)
        return leaf_path

    def records(self, at: str | None = None) -> dict[str, Leaf]:
        """The leaves under ``at``.

        **Arguments:**

        - `at`: a path prefix (None: every leaf).

        **Returns:** ``{path relative to at: Leaf}``.

        ```python
        list(ckpt.records("model"))  # ['b', 'w']
        ```
        """
        prefix = normalize_at(at)
        out = {}
        for path, leaf in self._leaves.items():
            rel = relative_to(path, prefix)
            if rel is not None:
                out[rel] = leaf
        return out

    def __contains__(self, path: object) -> bool:
        return path in self._leaves

    def __iter__(self) -> Iterator[str]:
        return iter(self._leaves)

    def __len__(self) -> int:
        return len(self._leaves)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.location)!r}, {len(self)} leaves, {self.nbytes} bytes)"

    # -- values ----------------------------------------------------------------------

    def __getitem__(self, path: str) -> Any:
        """A leaf (a lazy array, or the scalar itself) or, for a prefix, a subtree.

        **Arguments:**

        - `path`: a leaf's path, or a prefix of several.

        **Returns:** a `LazyArray`, a scalar, or nested dicts and lists of them.

        ```python
        ckpt["step"], ckpt["model/w"].shape, ckpt["model"]
        ```
        """
        if path in self._leaves:
            return self._value(self._leaves[path])
        if self.records(path):
            return self.tree(at=path)
        self.leaf(path)  # raises a KeyError with suggestions

    def tree(self, at: str | None = None) -> Any:
        """Nested dicts/lists of lazy arrays and scalars, rebuilt from the leaves' keys.

        **Arguments:**

        - `at`: a path prefix (None: everything).

        **Returns:** the subtree, nothing read yet.

        ```python
        lazy_opt_state = ckpt.tree(at="opt_state")
        ```
        """
        leaves = self.records(at).values()
        return build_plain_tree([(leaf.keys, self._value(leaf)) for leaf in leaves], depth(normalize_at(at)))

    def _value(self, leaf: Leaf) -> Any:
        """A leaf's value as far as is known without reading: lazy for stored arrays,
        the scalar for scalars, None for opaque leaves."""
        return self._lazy(leaf) if isinstance(leaf, StoredLeaf) else leaf.value()


class LazyEntry:
    """One stored array of a source: ``shape``, ``dtype`` and ``nbytes`` now, data on ``get()``."""

    def __init__(self, source: Source, leaf: StoredLeaf):
        self.source = source
        self.leaf = leaf

    @property
    def leaf_path(self) -> str:
        """The leaf's path in its source.

        **Returns:** the path (``model/w``).

        ```python
        ckpt["model/w"].leaf_path  # 'model/w'
        ```
        """
        return self.leaf.path

    @property
    def path(self) -> str:
        """Deprecated: `leaf_path` (``path`` is a checkpoint's location elsewhere)."""
        warnings.warn("LazyEntry.path is deprecated: use leaf_path.", DeprecationWarning, stacklevel=2)
        return self.leaf.path

    @property
    def shape(self) -> tuple[int, ...]:
        return self.leaf.shape

    @property
    def ndim(self) -> int:
        """The number of dimensions.

        **Returns:** ``len(shape)``.

        ```python
        ckpt["model/w"].ndim  # 2
        ```
        """
        return len(self.shape)

    @property
    def dtype(self) -> np.dtype:
        return self.leaf.value_dtype

    @property
    def nbytes(self) -> int:
        return self.leaf.nbytes

    def get(self) -> Any:
        """Read the data (a numpy array; a jax key array for PRNG keys)."""
        with self.source.consistent():
            return self.source._read([(self.leaf, None)])[0]

    def _stream(self) -> Any:
        """The stored values, to copy from by chunks (`_pieces.CopiedPiece`): read whole."""
        return np.asarray(self.get())

    def _saved_as(self, path: str, keys: tuple[KeyRecord, ...]) -> StoredLeaf:
        """The leaf this array becomes when it is saved at ``path`` (copied from its source)."""
        return self.leaf.copied(path, keys, tuple(self.shape), self.dtype, changed=False)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        data = np.asarray(self.get())
        return data if dtype is None else data.astype(dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.leaf_path!r}, shape={self.shape}, dtype={self.dtype})"


def check_one_tree(leaves: dict[str, Leaf], location: Any, name: Any = None) -> None:
    """Refuse leaves that do not describe one tree: a path that is a leaf and also holds
    other leaves (``a`` and ``a/c``) would lose one of them when the tree is rebuilt.
    ``name(path)`` is what the format calls the leaf (``a.c`` for safetensors)."""
    name = name or (lambda path: path)
    for path in leaves:
        for prefix in ancestors(path):
            if prefix in leaves:
                raise ManifestError(
                    f"{location}: {name(prefix)!r} is a tensor and also holds {name(path)!r}; one tree cannot "
                    "have both (one would be lost). Open it through a CheckpointTranslator that renames one of them."
                )


def did_you_mean(wanted: str, known: Iterable[str]) -> str:
    """`` Did you mean 'a/b'?`` naming the paths closest to ``wanted``, or "" if none is close."""
    close = difflib.get_close_matches(wanted, known, n=3)
    return f" Did you mean {', '.join(map(repr, close))}?" if close else ""


def nothing_under(source: Source, at: str | None) -> CheckpointError:
    """The error for an ``at=`` that selects nothing: the closest paths as deep as it
    (``model/layer/0``: ``model/layers/0``), a hint where it is written with dots or
    brackets (``model.layers[0]``), and what is at the top level."""
    prefix = normalize_at(at)
    tops = sorted({path.split("/")[0] for path in source.paths})
    # Python's spelling of a key path (`jax.tree_util.keystr`, attribute access) into eqxckpt's.
    slashed = re.sub(r"\[['\"]?([^\]'\"]*)['\"]?\]", r".\1", prefix).strip(".").replace(".", "/")
    hint = ""
    if slashed != prefix:
        hint = f" Paths use '/' between keys (at={slashed!r}, not at={prefix!r})."
    if not (slashed != prefix and source.records(slashed)):
        keys = depth(slashed)
        as_deep = {"/".join(path.split("/")[:keys]) for path in source.paths if depth(path) >= keys}
        hint = did_you_mean(slashed, as_deep) + hint
    return CheckpointError(
        f"Nothing under at={at!r} in {source.location}.{hint} Its top-level entries are: {', '.join(tops) or 'none'}."
    )
