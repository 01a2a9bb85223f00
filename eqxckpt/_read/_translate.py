"""`CheckpointTranslator`: regex rules from a foreign checkpoint's flat names to ours."""

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, overload

import numpy as np

from .._classify import leaf_of
from .._errors import TransformError
from .._leaf import ArrayLeaf, StoredLeaf
from .._paths import check_one_tree
from .._storage import reading
from ._lazy import LazyArray
from ._source import Boxes, Source

RuleFn = Callable[..., tuple[str | None, Any]]


class CheckpointTranslator:
    """Translate a flat ``{name: value}`` dict with regex rules.

    Each rule is ``fn(opts, key, value, *groups) -> (new_key, new_value)``. A rule
    matches a whole key, the first matching rule wins, a ``None`` new key drops
    the entry, and keys that no rule matches are an error listing them all.
    Values pass through untouched unless a rule changes them, so `LazyArray`s
    stay lazy.

    ```python
    translator = eqxckpt.CheckpointTranslator()

    @translator.add(r"encoder/block_(\\d+)/(\\w+)")
    def _(opts, key, value, block, name):
        return f"encoder/layers/{int(block)}/{name}", value

    translator.apply({"encoder/block_000/q": q})  # {'encoder/layers/0/q': q}
    ```
    """

    def __init__(self) -> None:
        self._rules: list[tuple[re.Pattern, RuleFn]] = []

    def add(self, pattern: str) -> Callable[[RuleFn], RuleFn]:
        """Decorator registering ``fn`` for keys that fully match ``pattern``.

        **Arguments:**

        - `pattern`: a regex; its groups are passed to the rule after the value.

        **Returns:** the decorator (it returns ``fn`` unchanged).

        ```python
        @translator.add(r"dense_(\\d+)/kernel")
        def _(opts, key, value, index):
            return f"layers/{index}/weight", value
        ```
        """
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise TransformError(f"Translator pattern {pattern!r} is not a valid regex: {e}.") from None

        def register(fn: RuleFn) -> RuleFn:
            self._rules.append((regex, fn))
            return fn

        return register

    @overload
    def apply(self, flat: Source, **opts: Any) -> "TranslatedSource": ...
    @overload
    def apply(self, flat: Mapping[str, Any], **opts: Any) -> dict[str, Any]: ...
    def apply(self, flat: Mapping[str, Any] | Source, **opts: Any) -> "dict[str, Any] | TranslatedSource":
        """Translate every entry; ``opts`` reach each rule as its first argument (a dict).

        **Arguments:**

        - `flat`: ``{name: value}``, or a source (an `eqxckpt.open` checkpoint,
          a foreign checkpoint): then each rule sees a leaf's lazy value, and
          the result is a source with the new names, which `eqxckpt.load`
          restores as it restores a checkpoint (reading only what it needs).
        - `opts`: options passed to every rule.

        **Returns:** the translated dict, or the translated source.

        ```python
        view = translator.apply(eqxckpt.open("foreign_ckpt"))
        model = eqxckpt.load(view, skeleton, at="model")
        ```
        """
        if isinstance(flat, Source):
            values = {path: flat[path] for path in flat.paths}
            return TranslatedSource(flat, values, self.apply(values, **opts))
        out: dict[str, Any] = {}
        origin: dict[str, str] = {}
        unmatched = []
        for key, value in flat.items():
            for regex, fn in self._rules:
                match = regex.fullmatch(key)
                if match is None:
                    continue
                try:
                    new_key, new_value = fn(opts, key, value, *match.groups())
                except Exception as e:
                    e.add_note(f"while translating {key!r} with rule {regex.pattern!r}")
                    raise
                if new_key is not None:
                    if new_key in out:
                        raise TransformError(f"Keys {origin[new_key]!r} and {key!r} both translate to {new_key!r}.")
                    out[new_key], origin[new_key] = new_value, key
                break
            else:
                unmatched.append(key)
        if unmatched:
            listed = "\n  ".join(unmatched[:100]) + (
                f"\n  ... and {len(unmatched) - 100} more" if len(unmatched) > 100 else ""
            )
            raise TransformError(
                f"{len(unmatched)} keys match no translation rule:\n  {listed}\nAdd a rule for them (return a None key to drop one)."
            )
        return out


@dataclasses.dataclass(frozen=True)
class Transposed:
    """What a rule returns for a stored matrix kept the other way round (HuggingFace's
    ``[out, in]``): the view's leaf has the reversed shape, so `load` checks it before
    reading, and the transpose happens as the leaf is read."""

    entry: LazyArray


class TranslatedSource(Source):
    """A source under translated names: a leaf whose value a rule passed on unchanged
    is read from the original source; a value a rule computed is held in memory."""

    def __init__(self, original: Source, values: dict[str, Any], translated: dict[str, Any]):
        self.original = original
        self.location = original.location
        self.arrays_only = original.arrays_only  # a rule's computed scalars are found, not missing
        self.metadata = original.metadata
        by_value = {
            id(value): leaf for path, value in values.items() if isinstance(leaf := original.leaf(path), StoredLeaf)
        }
        self._origin: dict[str, StoredLeaf] = {}
        self._computed: dict[str, Any] = {}
        self._transposed: set[str] = set()
        self._leaves = {}
        for path, value in translated.items():
            keys = tuple(("dict", part) for part in path.split("/"))
            transposed = isinstance(value, Transposed)
            origin = by_value.get(id(value.entry if transposed else value))
            if transposed and not isinstance(origin, ArrayLeaf):
                raise TransformError(f"The rule for {path!r} transposes something that is not an array of the source.")
            if transposed and origin is not None and origin.blocks is not None:
                raise TransformError(
                    f"The rule for {path!r} transposes {origin.path!r}, of which this checkpoint holds only some "
                    "blocks (one process's part): restore the whole leaf first, then transpose it."
                )
            if origin is not None:
                shape, digest = (origin.shape[::-1], None) if transposed else (origin.shape, origin.digest)
                self._leaves[path] = dataclasses.replace(origin, path=path, keys=keys, shape=shape, digest=digest)
                self._origin[path] = origin
                if transposed:
                    self._transposed.add(path)
            else:
                leaf, data = leaf_of(path, keys, np.asarray(value) if hasattr(value, "__array__") else value)
                self._leaves[path] = leaf
                self._computed[path] = data
        check_one_tree(self._leaves, self.location)  # two rules may make a leaf and a subtree of one name

    def origin(self, leaf_path: str) -> str:
        self.leaf(leaf_path)
        if leaf_path in self._origin:
            name = self.original.origin(self._origin[leaf_path].path)
            return f"{name} (transposed)" if leaf_path in self._transposed else name
        return leaf_path  # computed by a rule: it has no stored name

    def consistent(self) -> Any:
        return self.original.consistent()

    def _fetch(
        self, leaves: Sequence[StoredLeaf], done: Callable[[int, np.ndarray], None], reserve: Callable[[int], None]
    ) -> None:
        """A leaf passed on as its original source fetches it (as stored, then turned where
        a rule transposed it); one a rule computed, from memory."""
        passed = [(i, self._origin[leaf.path]) for i, leaf in enumerate(leaves) if leaf.path in self._origin]

        def fetched(j: int, data: np.ndarray) -> None:
            i, origin = passed[j]
            if leaves[i].path in self._transposed:
                # Its bytes as stored are the original's: checked against the original's digest.
                with reading(origin):
                    origin.check_whole(data)
                data = np.ascontiguousarray(data.T)
            done(i, data)

        if passed:
            self.original._fetch([origin for _, origin in passed], fetched, reserve)
        for i, leaf in enumerate(leaves):
            if leaf.path not in self._origin:
                done(i, np.array(self._computed[leaf.path]))

    def chunk_shapes(self, leaves: Sequence[StoredLeaf]) -> list[tuple[int, ...] | None]:
        """As the original reads a leaf passed on unchanged; a transposed or computed one is read whole."""
        unchanged = [leaf for leaf in leaves if leaf.path in self._origin and leaf.path not in self._transposed]
        found = self.original.chunk_shapes([self._origin[leaf.path] for leaf in unchanged]) if unchanged else []
        units = dict(zip((leaf.path for leaf in unchanged), found))
        return [units.get(leaf.path) for leaf in leaves]

    def _read_boxes(self, leaf: StoredLeaf, boxes: Boxes, window: int) -> None:
        """A leaf passed on unchanged, as its original source reads it."""
        origin = self._origin.get(leaf.path)
        if origin is not None and leaf.path not in self._transposed:
            return self.original._read_boxes(origin, boxes, window)
        super()._read_boxes(leaf, boxes, window)
