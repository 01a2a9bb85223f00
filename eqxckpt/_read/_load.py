"""`load`: restore a source (or a subtree of it) into the shape of ``like``.

One pipeline for every case: `plan` decides, from paths, shapes and dtypes
alone, which source leaf (or rule, or `like` value) feeds each leaf of the
result, and raises one error listing every difference; `Plan.run` then reads
exactly the stored leaves it needs, in one concurrent batch.
"""

import dataclasses
import time
from collections.abc import Callable
from typing import Any, TypedDict, TypeVar, Unpack, overload

import equinox as eqx
import jax
import numpy as np
from jaxtyping import PyTree

from .._arguments import checked_arguments
from .._errors import MAX_LISTED, CastError, CheckpointChangedError, StructureMismatchError, plural, warn_at_caller
from .._formats._convert import checked_astype, narrowed
from .._formats._open import open as open_source
from .._gc import collector_paused
from .._leaf import ArrayLeaf, Leaf, StoredLeaf, refuse_narrowing
from .._monitoring import LOAD_BYTES, LOAD_DURATION, record_bytes, record_duration
from .._paths import depth, normalize_at, nothing_under
from .._progress import Progress, reporting
from .._storage import CheckpointPath
from .._tree import SCALAR_TYPES, build_plain_tree, describe_like, flatten, is_array_like, is_prng_key_dtype
from .._window import limited_host_memory
from ._lazy import LazyArray
from ._read_once import failing_together, spans_processes
from ._restack import Layout, Row, plan_stack, plan_unstack, unrestored_rows
from ._restore import Item, restore
from ._source import Source
from ._transform import Rule, RuleKind, keypath_string, plan_rules, readable_path

# How often a load reads a checkpoint that another process replaced while it read it.
READ_ATTEMPTS = 3
Rows = list[tuple[str, str]]
_T = TypeVar("_T")


def resolve_like(like: Any) -> Any:
    """A constructor becomes its `eqx.filter_eval_shape` skeleton: no memory spent."""
    # A bare function is a pytree leaf; modules (even callable ones) are trees.
    if callable(like) and not isinstance(like, eqx.Module) and jax.tree_util.tree_leaves(like) == [like]:
        return eqx.filter_eval_shape(like)
    return like


@dataclasses.dataclass
class Computed:
    """A result leaf computed by a rule: ``value_fn`` of one source leaf, or ``multi_value_fn``."""

    slot: int
    path: str
    rule: Rule
    leaf: Leaf | None
    target: Any


@dataclasses.dataclass
class Plan:
    """Which source leaf (or rule, or `like` value) feeds each leaf of the result.

    ``values`` holds the result's leaves known without reading; ``reads`` the
    stored leaves to read into their slots; ``computed`` the rules to apply;
    ``layouts`` the leaves stacked from layers or taken as rows of a stacked leaf.
    With ``like=None`` there is no treedef: the result is rebuilt from keys.
    """

    source: Source
    prefix: str
    treedef: Any
    values: list[Any]
    reads: list[tuple[int, StoredLeaf, Any]] = dataclasses.field(default_factory=list)
    computed: list[Computed] = dataclasses.field(default_factory=list)
    layouts: list[tuple[int, Layout, Any]] = dataclasses.field(default_factory=list)  # `Stack`, `Unstack`
    missing: Rows = dataclasses.field(default_factory=list)
    unexpected: Rows = dataclasses.field(default_factory=list)
    mismatched: Rows = dataclasses.field(default_factory=list)
    kept: list[str] = dataclasses.field(default_factory=list)
    plain_keys: list[Any] = dataclasses.field(default_factory=list)
    cast: bool = False  # whether values may change dtype (stored ones, and those rules compute)
    flags: list[str] = dataclasses.field(default_factory=list)  # stored bools that differ from `like`'s

    def supply(self, slot: int, leaf: Leaf, target: Any) -> None:
        """``slot`` takes ``leaf``'s value: read later if stored, else known now."""
        if isinstance(leaf, StoredLeaf):
            self.reads.append((slot, leaf, target))
        else:
            self.values[slot] = leaf.value(target)
            if isinstance(target, bool) and isinstance(self.values[slot], bool) and self.values[slot] != target:
                self.flags.append(f"{leaf.path}: {self.values[slot]} (like: {target})")

    def named(self, leaf: Leaf, what: str) -> str:
        """``what`` about a source leaf, adding the name its own format gives it where that
        is not its path here (a safetensors tensor, a translated foreign variable)."""
        name = self.source.origin(leaf.path)
        return what if name == leaf.path else f"{what}, stored as {name}"

    def check(self, strict: bool) -> None:
        """Raise one error listing every difference; warn about what ``strict=False`` let through."""
        unexpected = self.unexpected if strict else []
        if self.missing or self.mismatched or unexpected:
            raise StructureMismatchError(
                report(
                    self.source.location,
                    self.prefix,
                    self.missing,
                    unexpected,
                    self.mismatched,
                    strict=strict,
                    at_hint=self.fitting_prefix(),
                ),
                missing=self.missing,
                unexpected=unexpected,
                mismatched=self.mismatched,
            )
        if self.flags:
            # Stored values win, as in eqx.tree_deserialise_leaves; a flag such as Dropout's
            # `inference` is the one users expect `like` to decide, so say it did not.
            warn_at_caller(
                f"eqxckpt.load from {self.source.location}: the checkpoint's values replace `like`'s where they "
                f"differ ({plural(len(self.flags), 'flag')}: {self.flags[:MAX_LISTED]}). Stored values always win; to choose a "
                "mode, apply it to the result (e.g. eqx.nn.inference_mode(loaded)).",
            )
        if self.kept or self.unexpected:
            hint = self.fitting_prefix([(path, "") for path in self.kept])
            warn_at_caller(
                f"eqxckpt.load(strict=False) from {self.source.location}: kept `like`'s values for "
                f"{len(self.kept)} leaves missing from the checkpoint {self.kept[:MAX_LISTED]}; ignored "
                f"{len(self.unexpected)} checkpoint leaves {[p for p, _ in self.unexpected[:MAX_LISTED]]}."
                + (f" Every kept leaf is in the checkpoint under {hint!r}: pass at={hint!r}." if hint else ""),
            )

    def fitting_prefix(self, missing: Rows | None = None) -> str | None:
        """An ``at=`` under which every missing leaf exists (the usual slip: a model saved
        inside ``{"model": ..., "opt_state": ...}`` loaded without ``at="model"``)."""
        missing = self.missing if missing is None else missing
        if not missing:
            return None
        paths = set(self.source.paths)
        base = f"{self.prefix}/" if self.prefix else ""
        tops = sorted({path[len(base) :].split("/")[0] for path in paths if path.startswith(base)})
        for top in tops:
            if all(f"{base}{top}/{rel}" in paths for rel, _ in missing):
                return base + top
        return None

    def stored(self) -> list[StoredLeaf]:
        """The stored leaves `run` reads (a `Stack`'s or `Unstack`'s result as if stored so)."""
        computed = [c.leaf for c in self.computed if isinstance(c.leaf, StoredLeaf)]
        return [leaf for _, leaf, _ in self.reads] + computed + [layout.leaf for _, layout, _ in self.layouts]

    def run(self, together: bool = False) -> Any:
        """Read what the plan needs (value_fn inputs in the same batch) and build the result;
        ``together``: every process of the job restores with this plan (`read_once`)."""
        inputs = [c.leaf for c in self.computed if isinstance(c.leaf, StoredLeaf)]
        wanted: list[Item] = [(leaf, target) for _, leaf, target in self.reads]
        wanted += [(leaf, None) for leaf in inputs]
        wanted += [(layout, target) for _, layout, target in self.layouts]
        values = restore(self.source, wanted, together)
        for (slot, _, _), value in zip(self.reads, values):
            self.values[slot] = value
        for (slot, _, _), value in zip(self.layouts, values[len(wanted) - len(self.layouts) :]):
            self.values[slot] = value
        read = dict(zip((leaf.path for leaf in inputs), values[len(self.reads) :]))
        lazy_original = None
        for c in self.computed:
            if c.leaf is None:
                if lazy_original is None:
                    lazy_original = self.source.tree(at=self.prefix or None)
                assert c.rule.multi_value_fn is not None
                value = c.rule.multi_value_fn(c.rule.key, lazy_original)
            else:
                assert c.rule.value_fn is not None
                value = c.rule.value_fn(read[c.leaf.path] if isinstance(c.leaf, StoredLeaf) else c.leaf.value())
            self.values[c.slot] = _place(c.path, value, c.target, self.cast)
        if self.treedef is None:
            return build_plain_tree(list(zip(self.plain_keys, self.values)), depth(self.prefix))
        return jax.tree_util.tree_unflatten(self.treedef, self.values)


def plan(
    source: Source,
    like: Any,
    *,
    at: str | None = None,
    strict: bool = True,
    cast: bool = False,
    transforms: Any = None,
    default_to_original: bool = True,
) -> Plan:
    """Decide where every leaf of the result comes from, reading nothing; arguments as for `load`.

    Raises `StructureMismatchError` listing every difference.
    """
    prefix = normalize_at(at)
    available = source.records(prefix)
    if not available and prefix:
        raise nothing_under(source, at)
    if like is None:
        return _plan_plain(source, prefix, available)
    flat, treedef = flatten(resolve_like(like))
    result = Plan(source, prefix, treedef, [None] * len(flat), cast=cast)
    if transforms is None:
        _match_paths(result, [(rel, target) for rel, _, target in flat], available, strict, cast)
    else:
        paths = [keypath_string(kp) for _, kp, _ in flat]
        targets = [target for _, _, target in flat]
        _match_rules(result, paths, targets, available, transforms, default_to_original, strict, cast)
    result.check(strict)
    return result


def _plan_plain(source: Source, prefix: str, available: dict[str, Leaf]) -> Plan:
    """``like=None``: every leaf as saved, in plain dicts and lists."""
    leaves = list(available.values())
    result = Plan(source, prefix, None, [None] * len(leaves), plain_keys=[leaf.keys for leaf in leaves])
    refuse_narrowing(
        ((leaf, None) for leaf in leaves if isinstance(leaf, StoredLeaf)),
        f"Cannot restore the leaves of {source.location} as saved",
    )
    result.mismatched = [
        (leaf.path, why) for leaf in leaves if isinstance(leaf, StoredLeaf) and (why := leaf.unheld(None)) is not None
    ]
    result.check(strict=True)
    for slot, leaf in enumerate(leaves):
        result.supply(slot, leaf, None)
    return result


def _match_paths(
    result: Plan, flat: list[tuple[str, Any]], available: dict[str, Leaf], strict: bool, cast: bool
) -> None:
    """Each leaf of `like` from the source leaf at the same path."""
    used: set[str] = set()
    for slot, (rel, target) in enumerate(flat):
        leaf = available.get(rel)
        if leaf is None:
            # A Python field no file of the format can hold is `like`'s, strict or not.
            wanted = is_array_like(target) or (isinstance(target, SCALAR_TYPES) and not result.source.arrays_only)
            if wanted and (strict or isinstance(target, jax.ShapeDtypeStruct)):
                result.missing.append((rel, f"expected {describe_like(target)}"))
            else:
                result.values[slot] = target
                if wanted:
                    result.kept.append(rel)
            continue
        used.add(rel)
        if (problem := leaf.mismatch(target, cast)) is not None:
            result.mismatched.append((rel, result.named(leaf, problem)))
        else:
            result.supply(slot, leaf, target)
    # A None the source records where `like` has an empty subtree is no difference.
    result.unexpected = [
        (rel, result.named(leaf, f"found {leaf.describe()}"))
        for rel, leaf in available.items()
        if rel not in used and not leaf.is_none
    ]


def _match_rules(
    result: Plan,
    paths: list[str],
    targets: list[Any],
    available: dict[str, Leaf],
    transforms: Any,
    default_to_original: bool,
    strict: bool,
    cast: bool,
) -> None:
    """Each leaf of `like` as the `Transform` rules say: planned on paths before anything is read."""
    by_key = {readable_path(leaf.keys[depth(result.prefix) :]): leaf for leaf in available.values()}
    rules = plan_rules(paths, set(by_key), transforms, default_to_original)
    produced: dict[Any, tuple[int, ...] | None] = {}
    rows: list[tuple[str, Row]] = []
    for slot, (path, target, rule) in enumerate(zip(paths, targets, rules)):
        restacked = rule.kind in (RuleKind.STACK, RuleKind.UNSTACK, RuleKind.MULTI) or rule.value_fn is not None
        if restacked and any(getattr(leaf, "blocks", None) for leaf in by_key.values()):
            # A process's part (a local tier's) holds some blocks of its arrays: only restored as stored.
            result.mismatched.append((path, "a process's part holds only blocks of its arrays: restore it as saved"))
        elif rule.kind in (RuleKind.STACK, RuleKind.UNSTACK):
            if rule.kind is RuleKind.STACK:
                layout = plan_stack(path, rule.key, target, by_key, strict, cast, result.source.origin)
            else:
                layout = plan_unstack(path, rule.key, rule.index, target, by_key, cast)
            if isinstance(layout, str):
                result.mismatched.append((path, layout))
            else:
                result.layouts.append((slot, layout, target))
                if isinstance(layout, Row):
                    rows.append((path, layout))
        elif rule.kind is RuleKind.NEW:
            if isinstance(target, jax.ShapeDtypeStruct):
                result.mismatched.append(
                    (path, f"expected {describe_like(target)}; no rule, checkpoint leaf or concrete value supplies it")
                )
            result.values[slot] = target
        elif rule.kind is RuleKind.MULTI:
            result.computed.append(Computed(slot, path, rule, None, target))
        elif rule.key not in by_key:
            result.mismatched.append((path, f"rule points at {rule.key!r}, which is not in the checkpoint"))
        elif rule.value_fn is not None:
            leaf = by_key[rule.key]
            shape = _produced_shape(rule.value_fn, leaf, produced)
            if shape is not None and is_array_like(target) and shape != tuple(target.shape):
                found = f"found {leaf.describe()}, which value_fn makes shape {list(shape)}"
                result.mismatched.append(
                    (path, result.named(leaf, f"expected {describe_like(target)}, {found} (from {rule.key!r})"))
                )
            else:
                result.computed.append(Computed(slot, path, rule, leaf, target))
        elif (problem := by_key[rule.key].mismatch(target, cast)) is not None:
            result.mismatched.append((path, result.named(by_key[rule.key], f"{problem} (from {rule.key!r})")))
        else:
            result.supply(slot, by_key[rule.key], target)
    if strict:  # a stacked leaf restored whole as well leaves no row unrestored
        whole = {by_key[r.key].path for r in rules if r.kind is RuleKind.ORIGINAL and r.key in by_key}
        result.mismatched.extend(unrestored_rows([(path, row) for path, row in rows if row.stacked.path not in whole]))


def _produced_shape(value_fn: Any, leaf: Leaf, known: dict[Any, tuple[int, ...] | None]) -> tuple[int, ...] | None:
    """The shape ``value_fn`` gives a stored array, traced without reading it (one trace per
    function, shape and dtype), so a misfit is in the plan's one error; None if unknown."""
    if not isinstance(leaf, ArrayLeaf):
        return None
    key = (value_fn, leaf.shape, leaf.dtype)
    if key not in known:
        try:
            out = jax.eval_shape(lambda x: value_fn(x), jax.ShapeDtypeStruct(leaf.shape, leaf.value_dtype))
            known[key] = tuple(out.shape) if isinstance(out, jax.ShapeDtypeStruct) else None
        except Exception:
            # A value_fn that needs concrete values (numpy calls, branches on data) is
            # checked when it has run, by `_place`.
            known[key] = None
    return known[key]


def report(
    location: Any,
    at: str,
    missing: Rows,
    unexpected: Rows,
    mismatched: Rows,
    *,
    strict: bool = True,
    at_hint: str | None = None,
) -> str:
    """The message of a `StructureMismatchError`: every difference, grouped, then what to do."""
    where = f"{location}" + (f" (at={at!r})" if at else "")
    lines = [f"Checkpoint {where} does not match `like`:", *differences(missing, unexpected, mismatched)]
    if at_hint is not None:
        lines.append(f"Every missing leaf is in the checkpoint under {at_hint!r}: pass at={at_hint!r}.")
    if not strict and missing:
        lines.append(
            "Not strict, load keeps `like`'s value for a leaf missing from the checkpoint, but `like` has no value "
            "for the missing leaves above: they are shapes only (jax.ShapeDtypeStruct, e.g. from "
            "eqx.filter_eval_shape). Pass a `like` holding arrays there (a freshly initialised model), or restore "
            "the rest and set these yourself."
        )
    if not strict and mismatched:
        lines.append(
            "Not strict, leaves may be missing or extra; a leaf whose shape, dtype or kind differs from `like`'s "
            "is still an error."
        )
    remedies = ["at='prefix' selects a subtree"]
    if strict:
        remedies.append("strict=False keeps `like`'s values for missing leaves and ignores extra ones")
    remedies += ["cast=True converts dtypes", "transforms remap paths"]
    lines.append("To restore anyway: " + ", ".join(remedies) + ".")
    return "\n".join(lines)


def differences(missing: Rows, unexpected: Rows, mismatched: Rows, like: str = "`like`") -> list[str]:
    """The lines listing every difference, grouped (`MAX_LISTED` of each at most); ``like``
    says what the checkpoint was restored into."""
    lines = []
    for title, rows in (
        ("missing from the checkpoint", missing),
        (f"in the checkpoint but not in {like}", unexpected),
        ("shape/dtype/kind mismatch", mismatched),
    ):
        if rows:
            lines.append(f"  {title} ({len(rows)}):")
            lines.extend(f"    {path or '<root>'}: {what}" for path, what in rows[:MAX_LISTED])
            if len(rows) > MAX_LISTED:
                lines.append(f"    ... and {len(rows) - MAX_LISTED} more")
    return lines


def _place(path: str, value: Any, target: Any, cast: bool) -> Any:
    """Put a computed value (from value_fn / multi_value_fn) where ``target`` wants it,
    under the rules stored values meet: same shape, same dtype unless ``cast``, and
    a cast that changes values beyond rounding refused."""
    if isinstance(value, LazyArray):
        value = value.get()
    if not is_array_like(target):
        return value
    produced = f"produced {describe_like(value) if is_array_like(value) else type(value).__name__}"
    if tuple(np.shape(value)) != tuple(target.shape):
        raise StructureMismatchError(
            f"Transform for {path!r} produced shape {tuple(np.shape(value))}, but `like` expects "
            f"{describe_like(target)}. Fix the value_fn/multi_value_fn or the model.",
            mismatched=[(path, f"produced shape {tuple(np.shape(value))}")],
        )
    if is_prng_key_dtype(target.dtype) or (is_array_like(value) and is_prng_key_dtype(value.dtype)):
        if not is_array_like(value) or value.dtype != target.dtype:
            raise StructureMismatchError(
                f"Transform for {path!r} {produced}, but `like` expects {describe_like(target)}.",
                mismatched=[(path, produced)],
            )
        return jax.device_put(value, getattr(target, "sharding", None))
    data = np.asarray(value)
    dtype = np.dtype(target.dtype)
    if data.dtype != dtype and not cast:
        raise StructureMismatchError(
            f"Transform for {path!r} {produced}, but `like` expects {describe_like(target)}. Pass cast=True "
            "to convert (the values are checked to fit), or return the dtype `like` has.",
            mismatched=[(path, f"{produced} (pass cast=True to convert)")],
        )
    into_jax = not isinstance(target, (np.ndarray, np.generic))
    if (why := narrowed(dtype, into_jax)) is not None:
        raise CastError(f"Transform for {path!r}: {why}.")
    data = checked_astype(data, dtype, path)
    if isinstance(target, np.ndarray):
        return data
    if isinstance(target, np.generic):
        return data[()]
    return jax.device_put(data, getattr(target, "sharding", None))


class _LoadOptions(TypedDict, total=False):
    """`load`'s keyword arguments, as its overloads take them."""

    at: str | None
    strict: bool
    cast: bool
    transforms: dict[str, Any] | None
    default_to_original: bool
    format: str | None
    progress: Progress
    host_memory_budget: int | None


# What a type checker knows `load` returns: ``like``'s type (a constructor's result's),
# and for ``like=None`` plain dicts and lists it cannot know.
@overload
def load(path: CheckpointPath | Source, like: None = None, **options: Unpack[_LoadOptions]) -> Any: ...
@overload
def load(path: CheckpointPath | Source, like: Callable[[], _T], **options: Unpack[_LoadOptions]) -> _T: ...
@overload
def load(path: CheckpointPath | Source, like: _T, **options: Unpack[_LoadOptions]) -> _T: ...


@checked_arguments
def load(
    path: CheckpointPath | Source,
    like: PyTree | None = None,
    *,
    at: str | None = None,
    strict: bool = True,
    cast: bool = False,
    transforms: dict[str, Any] | None = None,
    default_to_original: bool = True,
    format: str | None = None,
    progress: Progress = "auto",
    host_memory_budget: int | None = None,
) -> PyTree:
    """Restore a checkpoint (or the subtree ``at``) into the structure of ``like``.

    **Arguments:**

    - `path`: where the checkpoint is (as for `save`), or a `Checkpoint` or
      other source already opened (a translated view, a TensorFlow checkpoint).
    - `like`: a pytree of arrays, a pytree of `jax.ShapeDtypeStruct` (e.g. from
      `eqx.filter_eval_shape`; shardings on them are honoured), a zero-argument
      constructor (evaluated with `eqx.filter_eval_shape`, so nothing is
      initialised), or None to rebuild plain dicts/lists from the manifest.
    - `at`: a path prefix such as ``"model"``: restore only that subtree, and
      read only its bytes.
    - `strict`: if True (default), every array/scalar leaf of ``like`` must be in
      the checkpoint with the same shape and dtype, and every checkpoint leaf
      under ``at`` must be in ``like``; otherwise one error lists every
      difference. If False, missing leaves keep ``like``'s (concrete) values and
      extra checkpoint leaves are ignored, with a warning.
    - `cast`: convert stored dtypes to ``like``'s dtypes instead of refusing.
    - `transforms`: `Transform` rules (see `apply_transformations`) mapping
      ``like``'s paths to checkpoint paths, and `Stack` and `Unstack` rules
      that change the layout (per-layer weights into a scanned model, and
      back). Only the leaves the result needs are read; ``transforms={}``
      restores just the leaves ``like`` has.
    - `default_to_original`: as in `apply_transformations`.
    - `format`: as for `eqxckpt.open` (None: detected); `"safetensors"` reads a
      HuggingFace file or directory, tensor ``a.b.c`` at path ``a/b/c``.
    - `progress`: as for `eqxckpt.save` (``"auto"``: a bar on a terminal for a
      large or slow restore; True: always on a terminal; a callable receives
      the counts after each leaf).
    - `host_memory_budget`: bytes of host memory the restore may hold beyond
      the result's own (reads in flight, slices on their way to devices);
      None is 256 MiB. A leaf put on devices (sharded, or on one device and
      larger than the budget) is read and placed a band of rows at a time
      within it, and cast band by band.

    With several JAX processes every process calls `load` together, with the
    same ``like``: data that ``like``'s shardings replicate across processes is
    read from storage once in all, each process a part, and moved between them
    by a collective (see the scale guide).

    **Returns:** a pytree of the structure of ``like`` (plain dicts and lists
    for ``like=None``) holding the restored values.

    ```python
    skeleton = eqx.filter_eval_shape(make_model, jax.random.key(0))
    model = eqxckpt.load("checkpoints/step_100", skeleton, at="model")
    ```
    """

    # A `like` placed across processes: every process restores together, in step (`read_once`),
    # unless each restores from a checkpoint of its own.
    together = spans_processes(like) and not (isinstance(path, Source) and path.per_process)

    def attempt() -> Any:
        with collector_paused():  # records, plans and arrays per leaf, no cycles among them
            with failing_together(together):  # one process's failure here, every process's
                source = path if isinstance(path, Source) else open_source(path, format=format)
            with source.consistent():
                with failing_together(together):
                    planned = plan(
                        source,
                        like,
                        at=at,
                        strict=strict,
                        cast=cast,
                        transforms=transforms,
                        default_to_original=default_to_original,
                    )
                stored = planned.stored()
                nbytes = sum(leaf.nbytes for leaf in stored)
                with (
                    reporting(f"loading {source.location}", nbytes, len(stored), progress),
                    limited_host_memory(host_memory_budget),
                ):
                    result = planned.run(together)
                record_bytes(LOAD_BYTES, nbytes)
                return result

    # A checkpoint replaced while it is read is read again (a few times); in a
    # multi-process load the processes would have to agree on a retry, so there
    # the change is raised instead. An opened source is read once.
    # (Asked only after a change: a first restore's reads then overlap JAX's start-up.)
    called = time.perf_counter()
    if isinstance(path, Source):
        result = attempt()
        record_duration(LOAD_DURATION, called)
        return result
    for tries in range(1, READ_ATTEMPTS + 1):
        try:
            result = attempt()
            record_duration(LOAD_DURATION, called)
            return result
        except CheckpointChangedError:
            if tries == READ_ATTEMPTS or jax.process_count() > 1:
                raise
    raise AssertionError("unreachable")
