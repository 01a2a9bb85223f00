"""`load`: restore a checkpoint, or a subtree of it, into the shape of ``like``."""

import collections
import math
import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from ._checkpoint import Checkpoint, LazyArray, check_allocation, key_dtype, open, reading, wrap_prng
from ._errors import CastError, CheckpointChangedError, CheckpointError, StructureMismatchError
from ._manifest import LeafRecord, scalar_to_json
from ._paths import depth, normalize_at
from ._store import read_window
from ._transform import keypath_string, missing_originals, plan, readable_path
from ._tree import SCALAR_TYPES, describe_like, flatten, is_array_like, is_prng_key_dtype

MAX_LISTED = 50
# How often a load reads a checkpoint that another process replaced while it read it.
READ_ATTEMPTS = 3


def resolve_like(like: Any) -> Any:
    """A constructor becomes its `eqx.filter_eval_shape` skeleton: no memory spent."""
    # A bare function is a pytree leaf; modules (even callable ones) are trees.
    if callable(like) and not isinstance(like, eqx.Module) and jax.tree_util.tree_leaves(like) == [like]:
        return eqx.filter_eval_shape(like)
    return like


def _mismatch(record: LeafRecord, target: Any, cast: bool) -> str | None:
    """Why ``record`` cannot restore into ``target``, or None if it can."""
    found = f"found {record.describe()}"
    expected = f"expected {describe_like(target)}"
    if is_array_like(target):
        if not record.is_stored:
            return f"{expected}, {found}"
        if is_prng_key_dtype(target.dtype):
            if record.kind != "prng_key" or key_dtype(record.impl) != target.dtype:
                return f"{expected}, {found}"
        elif record.kind != "array":
            return f"{expected}, {found}"
        elif np.dtype(target.dtype).name != record.dtype and not cast:
            return f"{expected}, {found} (pass cast=True to convert)"
        if tuple(np.shape(target)) != record.shape:
            return f"{expected}, {found}"
        if (narrowed := _narrowed(record, target)) is not None:
            return f"{expected}, {found}: {narrowed}"
        return None
    if isinstance(target, SCALAR_TYPES):
        if record.kind != "scalar" or record.type_name != scalar_to_json(target)[0]:
            return f"{expected}, {found}"
        return None
    if record.kind != "opaque":
        return f"{expected}, {found}"
    return None


def _narrowed(record: LeafRecord, target: Any) -> str | None:
    """Why JAX would silently narrow what is restored (64-bit data with x64 off), or None."""
    if jax.config.read("jax_enable_x64") or record.kind != "array":
        return None
    dtype = np.dtype(getattr(target, "dtype", None) or record.dtype)
    into_jax = isinstance(target, jax.Array) or (
        (target is None or isinstance(target, jax.ShapeDtypeStruct))
        and (record.array_type == "jax" or getattr(target, "sharding", None) is not None)
    )
    if not into_jax or dtype.itemsize < 8 or dtype.kind not in "iufc" or dtype.name == "complex64":
        return None
    return (
        f"{dtype.name} would become {jax.dtypes.canonicalize_dtype(dtype).name} in JAX, since this process has "
        "jax_enable_x64 off. Enable it (jax.config.update('jax_enable_x64', True)), restore into numpy "
        "leaves, or pass cast=True with a 32-bit `like` (the values are checked to fit)"
    )


def checked_astype(data: np.ndarray, dtype: Any, path: str) -> np.ndarray:
    """``data`` cast to ``dtype`` (an explicit ``cast=True``), refusing values that would change
    beyond rounding: integers out of range, NaN or infinities into integers, finite floats
    that overflow. Floats that underflow to zero are cast with a warning."""
    dtype = np.dtype(dtype)
    if data.dtype == dtype:
        return data
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):  # checked below
        out = data.astype(dtype)
    if data.dtype.kind not in "iufc" or not data.size:
        return out
    parts = [data.real, data.imag] if data.dtype.kind == "c" else [data]
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        for part in parts:
            if not np.isfinite(part).all():
                raise CastError(
                    f"Leaf {path!r}: cast=True to {dtype.name} met NaN or infinity, which "
                    f"{dtype.name} cannot hold. Restore into a float `like`."
                )
            if part.min() < info.min or part.max() > info.max:
                raise CastError(
                    f"Leaf {path!r}: cast=True to {dtype.name} met values from {part.min()} to "
                    f"{part.max()}, outside [{info.min}, {info.max}]. Restore into a wider `like` "
                    "(with jax_enable_x64 on, or numpy leaves)."
                )
    elif dtype.kind in "fc":
        for before, after in zip(parts, [out.real, out.imag] if dtype.kind == "c" else [out]):
            if (np.isfinite(before) & ~np.isfinite(after)).any():
                raise CastError(
                    f"Leaf {path!r}: cast=True to {dtype.name} would turn finite values into "
                    "infinities (they are beyond its range). Restore into a wider `like`."
                )
            if ((before != 0) & (after == 0)).any():
                warnings.warn(
                    f"Leaf {path!r}: cast=True to {dtype.name} flushed tiny nonzero values to zero.", stacklevel=6
                )
    return out


def _report(location: Any, at: str, missing, unexpected, mismatched) -> str:
    where = f"{location}" + (f" (at={at!r})" if at else "")
    lines = [f"Checkpoint {where} does not match `like`:"]
    for title, rows in (
        ("missing from the checkpoint", missing),
        ("in the checkpoint but not in `like`", unexpected),
        ("shape/dtype/kind mismatch", mismatched),
    ):
        if rows:
            lines.append(f"  {title} ({len(rows)}):")
            lines.extend(f"    {path or '<root>'}: {what}" for path, what in rows[:MAX_LISTED])
            if len(rows) > MAX_LISTED:
                lines.append(f"    ... and {len(rows) - MAX_LISTED} more")
    lines.append(
        "To restore anyway: at='prefix' selects a subtree, strict=False keeps `like`'s values for "
        "missing leaves and ignores extra ones, cast=True converts dtypes, transforms remap paths."
    )
    return "\n".join(lines)


def _to_target(record: LeafRecord, target: Any, data: np.ndarray) -> Any:
    if record.kind == "prng_key":
        value = wrap_prng(record, data)
        sharding = getattr(target, "sharding", None)
        return value if sharding is None else jax.device_put(value, sharding)
    if data.dtype != np.dtype(getattr(target, "dtype", data.dtype)):
        data = checked_astype(data, target.dtype, record.path)
    sharding = getattr(target, "sharding", None)
    if isinstance(target, np.ndarray):
        return data
    if isinstance(target, np.generic):
        return data[()]
    if target is None or (isinstance(target, jax.ShapeDtypeStruct) and sharding is None):
        # No concrete type asked for (like=None or a skeleton): give back what was saved.
        if record.array_type == "numpy":
            return data
        if record.array_type == "numpy_scalar":
            return data[()]
    return adopt(data, sharding)


def adopt(data: np.ndarray, sharding: Any = None) -> jax.Array:
    """``data`` as a jax array; on a CPU device without a copy where possible.

    XLA's CPU client can take over a 64-byte aligned buffer through DLPack, so
    a restore does not hold every leaf twice; ``data`` must not be used after.
    Other devices, and dtypes DLPack lacks (bfloat16, float8, int4), take one
    copy with ``jax.device_put`` (not ``jnp.asarray``: measured ~25% faster).
    """
    if sharding is None:
        device = jax.local_devices()[0] if jax.config.jax_default_device is None else None
    else:
        device = next(iter(sharding.device_set)) if len(sharding.device_set) == 1 else None
    if device is not None and device.platform == "cpu" and data.ctypes.data % 64 == 0 and data.flags.c_contiguous:
        try:
            adopted = jax.dlpack.from_dlpack(data, device=device)
            # Same device: device_put only relabels the sharding, it does not copy.
            return adopted if sharding is None else jax.device_put(adopted, sharding)
        except BufferError:  # a dtype DLPack cannot describe
            pass
    return jax.device_put(data, sharding)


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, alignment: int = 64) -> np.ndarray:
    """An uninitialised C-order array whose data starts on an ``alignment`` boundary."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def _sharded(record: LeafRecord, target: Any) -> bool:
    """Whether to read ``target`` slice by slice: each device's slice, on its process."""
    sharding = getattr(target, "sharding", None)
    if sharding is None or (len(sharding.device_set) == 1 and sharding.is_fully_addressable):
        return False
    # Key data has trailing dimensions; only a NamedSharding says how to lay those out.
    return record.kind == "array" or isinstance(sharding, jax.sharding.NamedSharding)


def _slice_key(index: tuple, shape: tuple[int, ...]) -> tuple:
    """A hashable, normalised form of an index into ``shape``."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _start_slices(record: LeafRecord, target: Any, store: Any) -> dict:
    """Start reading every distinct slice this process's devices hold (once each,
    however many local devices hold a replica of it)."""
    reads = {}
    for index in target.sharding.addressable_devices_indices_map(record.shape).values():
        key = _slice_key(index, record.shape)
        if key not in reads:
            reads[key] = store[index].read()
    return reads


def _assemble(record: LeafRecord, target: Any, reads: dict) -> jax.Array:
    """A global array from this process's slices; other processes supply theirs."""
    slices = {key: future.result() for key, future in reads.items()}
    ndim = len(record.shape)
    if record.kind == "prng_key":
        data = jax.make_array_from_callback(
            record.data_shape, target.sharding, lambda idx: slices[_slice_key(idx[:ndim], record.shape)]
        )
        return jax.random.wrap_key_data(data, impl=record.impl)
    dtype = np.dtype(target.dtype)
    return jax.make_array_from_callback(
        record.shape,
        target.sharding,
        lambda idx: checked_astype(slices[_slice_key(idx, record.shape)], dtype, record.path),
    )


def _read(checkpoint: Checkpoint, reads: list[tuple[LeafRecord, Any]]) -> list[Any]:
    """Read every selected leaf: all opens at once, then reads straight into the
    final buffers, concurrently within a `read_window`."""
    opens = [checkpoint.open_array(record) for record, _ in reads]
    stores = [checkpoint.checked(record, opened) for (record, _), opened in zip(reads, opens)]
    check_allocation(
        sum(record.nbytes for (record, target) in reads if not _sharded(record, target)),
        f"Restoring {len(reads)} leaves from {checkpoint.location}",
    )
    values: list[Any] = [None] * len(reads)
    sharded = {
        i: _start_slices(record, target, store)
        for i, ((record, target), store) in enumerate(zip(reads, stores))
        if _sharded(record, target)
    }
    pending: collections.deque = collections.deque()
    in_flight = 0
    window = read_window(sum(record.nbytes for record, _ in reads))

    def finish_oldest() -> None:
        nonlocal in_flight
        i, buffer, copied = pending.popleft()
        record, target = reads[i]
        with reading(record):
            copied.result()
            values[i] = _to_target(record, target, buffer)
        in_flight -= buffer.nbytes

    for i, ((record, _), store) in enumerate(zip(reads, stores)):
        if i in sharded:
            continue
        while pending and in_flight + record.nbytes > window:
            finish_oldest()
        # TensorStore copies the leaf into our aligned buffer, which the jax array then adopts.
        buffer = aligned_empty(record.data_shape, np.dtype(record.dtype))
        pending.append((i, buffer, ts.array(buffer, copy=False, write=True).write(store)))
        in_flight += buffer.nbytes
    while pending:
        finish_oldest()
    for i, slices in sharded.items():
        with reading(reads[i][0]):
            values[i] = _assemble(reads[i][0], reads[i][1], slices)
    return values


class _Node(dict):
    """A container being rebuilt from key records; ``kind`` says dict or list."""

    kind = "dict"


def build_plain_tree(pairs: list[tuple[LeafRecord, Any]], depth: int) -> Any:
    """Nested dicts and lists from manifest key records (``like=None``)."""
    if len(pairs) == 1 and len(pairs[0][0].keys) == depth:
        return pairs[0][1]
    root = _Node()
    for record, value in pairs:
        node = root
        keys = record.keys[depth:]
        for i, (kind, key, *_) in enumerate(keys):
            node.kind = "list" if kind in ("seq", "index") else "dict"
            if i == len(keys) - 1:
                node[key] = value
            else:
                node = node.setdefault(key, _Node())
    return _freeze(root)


def _freeze(node: Any) -> Any:
    if not isinstance(node, _Node):
        return node
    if node.kind == "list":
        out = [None] * (max(node) + 1 if node else 0)
        for index, child in node.items():
            out[index] = _freeze(child)
        return out
    return {key: _freeze(child) for key, child in node.items()}


def load(
    path: Any,
    like: Any = None,
    *,
    at: str | None = None,
    strict: bool = True,
    cast: bool = False,
    transforms: Any = None,
    default_to_original: bool = True,
) -> Any:
    """Restore a checkpoint (or the subtree ``at``) into the structure of ``like``.

    **Arguments:**

    - `path`: where the checkpoint is (as for `save`).
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
      ``like``'s paths to checkpoint paths. Only the leaves the result needs
      are read; ``transforms={}`` restores just the leaves ``like`` has.
    - `default_to_original`: as in `apply_transformations`.

    ```python
    skeleton = eqx.filter_eval_shape(make_model, jax.random.key(0))
    model = eqxckpt.load("ckpt/step_100", skeleton, at="model")
    ```
    """

    # A checkpoint replaced while it is read is read again (a few times); in a
    # multi-process load the processes would have to agree on a retry, so there
    # the change is raised instead.
    def attempt() -> Any:
        checkpoint = open(path)
        with checkpoint.consistent():
            return _load_from(checkpoint, like, at, strict, cast, transforms, default_to_original)

    for _ in range(0 if jax.process_count() > 1 else READ_ATTEMPTS - 1):
        try:
            return attempt()
        except CheckpointChangedError:
            pass
    return attempt()


def _load_from(
    checkpoint: Checkpoint,
    like: Any,
    at: str | None,
    strict: bool,
    cast: bool,
    transforms: Any,
    default_to_original: bool,
) -> Any:
    prefix = normalize_at(at)
    available = checkpoint.records(prefix)
    if not available and prefix:
        tops = sorted({p.split("/")[0] for p in checkpoint.paths})
        raise CheckpointError(
            f"Nothing under at={at!r} in {checkpoint.location}. Its top-level entries are: {', '.join(tops) or 'none'}."
        )
    if like is None:
        stored = [r for r in available.values() if r.is_stored]
        narrowed = [(r.path, why) for r in stored if (why := _narrowed(r, None)) is not None]
        if narrowed:
            raise CastError(
                f"Cannot restore {len(narrowed)} leaves of {checkpoint.location} without changing them: "
                + "; ".join(f"{path}: {why}" for path, why in narrowed[:MAX_LISTED])
                + "."
            )
        values = dict(zip((r.path for r in stored), _read(checkpoint, [(r, None) for r in stored])))
        pairs = [(r, values[r.path] if r.is_stored else checkpoint.value(r)) for r in available.values()]
        return build_plain_tree(pairs, depth(prefix))

    like = resolve_like(like)
    if transforms is not None:
        return _load_transformed(checkpoint, prefix, available, like, transforms, default_to_original, cast)
    flat, treedef = flatten(like)
    out: list[Any] = [None] * len(flat)
    reads: list[tuple[int, LeafRecord, Any]] = []
    missing, mismatched, kept = [], [], []
    used: set[str] = set()
    for i, (rel, _, target) in enumerate(flat):
        record = available.get(rel)
        if record is None:
            wanted = is_array_like(target) or isinstance(target, SCALAR_TYPES)
            if wanted and (strict or isinstance(target, jax.ShapeDtypeStruct)):
                missing.append((rel, f"expected {describe_like(target)}"))
            else:
                out[i] = target
                if wanted:
                    kept.append(rel)
            continue
        used.add(rel)
        problem = _mismatch(record, target, cast)
        if problem:
            mismatched.append((rel, problem))
        elif record.is_stored:
            reads.append((i, record, target))
        else:
            out[i] = _unstored(checkpoint, record, target)
    # A None the checkpoint records where `like` has an empty subtree is no difference.
    unexpected = [
        (rel, f"found {r.describe()}")
        for rel, r in available.items()
        if rel not in used and not (r.kind == "scalar" and r.type_name == "none")
    ]
    if missing or mismatched or (unexpected and strict):
        raise StructureMismatchError(
            _report(checkpoint.location, prefix, missing, unexpected if strict else [], mismatched)
        )
    if kept or unexpected:
        warnings.warn(
            f"eqxckpt.load(strict=False) from {checkpoint.location}: kept `like`'s values for "
            f"{len(kept)} leaves missing from the checkpoint {kept[:MAX_LISTED]}; ignored "
            f"{len(unexpected)} checkpoint leaves {[p for p, _ in unexpected[:MAX_LISTED]]}.",
            stacklevel=3,
        )
    for (i, _, _), value in zip(reads, _read(checkpoint, [(r, t) for _, r, t in reads])):
        out[i] = value
    return jax.tree_util.tree_unflatten(treedef, out)


def _unstored(checkpoint: Checkpoint, record: LeafRecord, target: Any) -> Any:
    """Scalars come from the manifest; opaque leaves (functions...) from ``like``."""
    return checkpoint.value(record) if record.kind == "scalar" else target


def _place(path: str, value: Any, target: Any) -> Any:
    """Put a computed value (from value_fn / multi_value_fn) where ``target`` wants it."""
    if isinstance(value, LazyArray):
        value = value.get()
    if not is_array_like(target):
        return value
    if tuple(np.shape(value)) != tuple(target.shape):
        raise StructureMismatchError(
            f"Transform for {path!r} produced shape {tuple(np.shape(value))}, but `like` expects "
            f"{describe_like(target)}. Fix the value_fn/multi_value_fn or the model."
        )
    if isinstance(target, np.ndarray):
        return np.asarray(value, dtype=target.dtype)
    if isinstance(target, np.generic):
        return np.asarray(value, dtype=target.dtype)[()]
    return jax.device_put(jnp.asarray(value, dtype=target.dtype), getattr(target, "sharding", None))


def _load_transformed(checkpoint, prefix, available, like, transforms, default_to_original, cast) -> Any:
    """`load` with `Transform` rules: plan on paths first, then read only what is used."""
    by_key = {readable_path(r.keys[depth(prefix) :]): r for r in available.values()}
    flat, treedef = flatten(like)
    new_paths = [keypath_string(kp) for _, kp, _ in flat]
    sources = plan(new_paths, set(by_key), transforms, default_to_original)
    problems = [
        (p, f"rule points at {k!r}, which is not in the checkpoint")
        for p, k in missing_originals(new_paths, sources, set(by_key))
    ]
    out: list[Any] = [None] * len(flat)
    reads, computed = [], []
    for i, ((_, _, target), path, source) in enumerate(zip(flat, new_paths, sources)):
        if source.kind == "new":
            if isinstance(target, jax.ShapeDtypeStruct):
                problems.append(
                    (path, f"expected {describe_like(target)}; no rule, checkpoint leaf or concrete value supplies it")
                )
            out[i] = target
        elif source.kind == "multi":
            computed.append((i, path, source, None, target))
        elif source.key in by_key:
            record = by_key[source.key]
            value_fn = source.transform.value_fn if source.transform else None
            if value_fn is not None:
                computed.append((i, path, source, record, target))
            elif (problem := _mismatch(record, target, cast)) is not None:
                problems.append((path, f"{problem} (from {source.key!r})"))
            elif record.is_stored:
                reads.append((i, record, target))
            else:
                out[i] = _unstored(checkpoint, record, target)
    if problems:
        raise StructureMismatchError(_report(checkpoint.location, prefix, [], [], problems))
    # One concurrent read for every stored leaf used, including value_fn inputs.
    stored_inputs = [(r, None) for _, _, _, r, _ in computed if r is not None and r.is_stored]
    values = _read(checkpoint, [(r, t) for _, r, t in reads] + stored_inputs)
    for (i, _, _), value in zip(reads, values):
        out[i] = value
    inputs = dict(zip((r.path for r, _ in stored_inputs), values[len(reads) :]))
    lazy_original = None
    for i, path, source, record, target in computed:
        if record is None:
            if lazy_original is None:
                lazy_original = checkpoint.tree(at=prefix or None)
            value = source.transform.multi_value_fn(source.key, lazy_original)
        else:
            value = source.transform.value_fn(inputs[record.path] if record.is_stored else checkpoint.value(record))
        out[i] = _place(path, value, target)
    return jax.tree_util.tree_unflatten(treedef, out)
