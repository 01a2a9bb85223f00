"""`CheckpointTranslator`: regex rules from a foreign checkpoint's flat names to ours."""

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, overload

import numpy as np

from .._chunks import Region
from .._classify import leaf_of
from .._errors import TransformError
from .._leaf import ArrayLeaf, StoredLeaf
from .._paths import check_one_tree
from ._lazy import LazyArray
from ._select import Selection
from ._source import Source

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

    def _read(self, wanted: Sequence[tuple[StoredLeaf, Any]]) -> list[Any]:
        values: list[Any] = [None] * len(wanted)
        passed = [
            (i, self._origin[leaf.path], target) for i, (leaf, target) in enumerate(wanted) if leaf.path in self._origin
        ]
        # A transposed leaf is read as stored (into numpy: never narrowed by JAX on the way),
        # then turned and finished into its target here.
        turned = {i for i, _, _ in passed if wanted[i][0].path in self._transposed}
        stored = [(origin, origin.host_target() if i in turned else target) for i, origin, target in passed]
        for (i, _, target), value in zip(passed, self.original.read(stored)):
            if i in turned:
                value = wanted[i][0].finish(np.ascontiguousarray(np.asarray(value).T), target)
            values[i] = value
        for i, (leaf, target) in enumerate(wanted):
            if leaf.path not in self._origin:
                values[i] = leaf.finish(np.array(self._computed[leaf.path]), target)
        return values

    def prepare_reads(self, leaves: Sequence[StoredLeaf]) -> None:
        """As the original source prepares the leaves they were passed on from."""
        self.original.prepare_reads([self._origin[leaf.path] for leaf in leaves if leaf.path in self._origin])

    def rows_per_read(self, leaf: StoredLeaf) -> int:
        """As the original reads a leaf passed on unchanged; a transposed or computed one is read whole."""
        origin = self._origin.get(leaf.path)
        if origin is not None and leaf.path not in self._transposed:
            return self.original.rows_per_read(origin)
        return super().rows_per_read(leaf)

    def _read_into(self, leaf: StoredLeaf, region: Region, out: np.ndarray) -> None:
        """A leaf passed on unchanged, as its original source reads it into ``out``."""
        origin = self._origin.get(leaf.path)
        if origin is not None and leaf.path not in self._transposed:
            return self.original.read_into(origin, region, out)
        super()._read_into(leaf, region, out)

    def read_selection(self, leaf: StoredLeaf, selection: Selection) -> np.ndarray:
        """A leaf passed on unchanged, as its original source reads it (only what the
        selection needs, where the format allows); a transposed or computed one whole."""
        origin = self._origin.get(leaf.path)
        if origin is not None and leaf.path not in self._transposed:
            return self.original.read_selection(origin, selection)
        if origin is not None:
            whole = self.original.read_selection(origin, Selection.of((), origin.data_shape))
            return selection.take(np.ascontiguousarray(whole.T))
        return selection.take(np.asarray(self._computed[leaf.path]))
