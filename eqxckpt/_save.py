"""`save`: write a pytree as per-leaf zarr3 arrays plus a manifest, atomically."""

import atexit
import concurrent.futures
import json
import os
import pathlib
import shutil
import sys
import threading
import uuid
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from ._errors import CheckpointError, CheckpointExistsError
from ._manifest import LeafRecord, Manifest, scalar_to_json
from ._paths import MANIFEST_NAME, key_entry_record
from ._store import Location, array_spec, check_dtype, exchange, fsync_path, fsync_tree, shared_context, resolve
from ._tree import SCALAR_TYPES, flatten, is_array_like, is_prng_key_dtype, type_name


class SaveHandle:
    """A save in progress (or done). ``wait()`` blocks and re-raises its error.

    ```python
    handle = eqxckpt.save("ckpt", tree, blocking=False)
    ...  # keep training
    handle.wait()
    ```
    """

    def __init__(self, path: str, future: concurrent.futures.Future):
        self.path = path
        self._future = future
        self._observed = False

    def done(self) -> bool:
        """Whether the save has finished (successfully or not)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save is committed; re-raise its exception if it failed."""
        self._observed = True
        self._future.result(timeout)

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"SaveHandle({self.path!r}, {state})"


_executor: concurrent.futures.ThreadPoolExecutor | None = None
_in_flight: dict[str, SaveHandle] = {}
_lock = threading.Lock()


def _background() -> concurrent.futures.ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="eqxckpt-save")
    return _executor


@atexit.register
def _finish_pending_saves() -> None:
    # A background save must not vanish with the interpreter, nor its error.
    for handle in list(_in_flight.values()):
        try:
            handle._future.result()
        except Exception as e:  # noqa: BLE001 - reported, interpreter is exiting
            if not handle._observed:
                print(f"eqxckpt: background save to {handle.path} failed: {e!r}", file=sys.stderr)


def _plan(tree: Any) -> tuple[list[LeafRecord], list[tuple[LeafRecord, Any]]]:
    """Classify every leaf: manifest records, and the arrays to write."""
    flat, _ = flatten(tree)
    records: list[LeafRecord] = []
    arrays: list[tuple[LeafRecord, Any]] = []
    for path, keypath, leaf in flat:
        if not path:
            raise CheckpointError(
                "save needs a container at the top of the tree (a module, dict, list...); "
                "wrap a single array, e.g. save(path, {'x': array})."
            )
        keys = tuple(tuple(key_entry_record(e)) for e in keypath)
        if is_array_like(leaf) and not isinstance(leaf, jax.ShapeDtypeStruct):
            if isinstance(leaf, jax.Array) and is_prng_key_dtype(leaf.dtype):
                data = jax.random.key_data(leaf)
                impl = str(jax.random.key_impl(leaf))
                record = LeafRecord(path, keys, "prng_key", tuple(leaf.shape), np.dtype(data.dtype).name,
                                    impl=impl, value=tuple(data.shape[leaf.ndim:]))
                arrays.append((record, data))
            else:
                dtype = np.dtype(leaf.dtype)
                check_dtype(dtype, path)
                if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
                    raise CheckpointError(
                        f"Leaf {path!r} is a multi-process array; saving from several processes "
                        "is not supported by this version of eqxckpt."
                    )
                array_type = "jax" if isinstance(leaf, jax.Array) else "numpy" if isinstance(leaf, np.ndarray) else "numpy_scalar"
                record = LeafRecord(path, keys, "array", tuple(np.shape(leaf)), dtype.name, array_type=array_type)
                arrays.append((record, leaf))
        elif isinstance(leaf, SCALAR_TYPES) or leaf is None:
            kind, value = scalar_to_json(str(leaf) if isinstance(leaf, (np.str_,)) else leaf)
            record = LeafRecord(path, keys, "scalar", value=value, type_name=kind)
        else:
            record = LeafRecord(path, keys, "opaque", type_name=type_name(leaf))
        records.append(record)
    return records, arrays


def _host(value: Any, copy: bool) -> np.ndarray:
    """The array as host memory; ``copy`` when the caller may reuse the buffer."""
    return np.array(value, copy=True) if copy else np.asarray(value)


def _check_target(final: pathlib.Path | None, overwrite: bool) -> None:
    """Refuse to replace a checkpoint without ``overwrite``, or anything else ever."""
    if final is None:
        return
    if final.exists() and not final.is_dir():
        raise CheckpointError(f"Cannot save to {final}: it is a file, not a directory.")
    if not final.is_dir():
        return
    is_checkpoint = (final / MANIFEST_NAME).exists()
    if is_checkpoint and not overwrite:
        raise CheckpointExistsError(
            f"A checkpoint already exists at {final}. Pass overwrite=True to replace it, or save to a new path."
        )
    if not is_checkpoint and any(final.iterdir()):
        raise CheckpointExistsError(
            f"{final} exists and is not an eqxckpt checkpoint (no {MANIFEST_NAME}); refusing to "
            "replace it. Choose another path or remove it yourself."
        )


def _write_arrays(location: Location, arrays: list[tuple[LeafRecord, np.ndarray]], context: ts.Context) -> None:
    # Every open and every write is issued before any is awaited, so TensorStore
    # runs them all concurrently on its own thread pools.
    opens = [
        ts.open(array_spec(location.child(rec.path), rec.data_shape, np.dtype(rec.dtype)), context=context)
        for rec, _ in arrays
    ]
    writes = [opened.result().write(data) for opened, (_, data) in zip(opens, arrays)]
    for (rec, _), write in zip(arrays, writes):
        try:
            write.result()
        except Exception as e:
            raise CheckpointError(f"Writing leaf {rec.path!r} failed: {e}") from e


def _write_local(location: Location, manifest: Manifest, arrays, overwrite: bool) -> None:
    final = location.local
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.eqxckpt-tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        _write_arrays(location.with_local(tmp), arrays, shared_context())
        with open(tmp / MANIFEST_NAME, "wb") as f:
            f.write(manifest.to_bytes())
            f.flush()
            os.fsync(f.fileno())
        fsync_tree(tmp)
        _commit(tmp, final, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(final.parent)


def _commit(tmp: pathlib.Path, final: pathlib.Path, overwrite: bool) -> None:
    """Move the finished temporary directory into place, atomically."""
    _check_target(final, overwrite)  # again: another writer may have committed meanwhile
    if not final.exists():
        try:
            os.rename(tmp, final)
        except OSError as e:  # another save committed first (ENOTEMPTY/EEXIST)
            raise CheckpointExistsError(f"Another save committed {final} first; this one was discarded.") from e
        return
    # Replace: swap atomically where the OS can, so a reader always sees a
    # complete checkpoint; else move the old one aside first (it stays complete).
    if exchange(tmp, final):
        shutil.rmtree(tmp, ignore_errors=True)
        return
    aside = final.parent / f".{final.name}.eqxckpt-old-{uuid.uuid4().hex[:12]}"
    os.rename(final, aside)
    os.rename(tmp, final)
    shutil.rmtree(aside, ignore_errors=True)


def _is_array_key(key: bytes) -> bool:
    """Whether a key is what a zarr3 array leaves behind (metadata or a chunk)."""
    parts = key.decode("utf-8", "replace").split("/")
    return parts[-1] == "zarr.json" or "c" in parts[:-1] or parts[-1] == "c"


def _write_object_store(location: Location, manifest: Manifest, arrays, overwrite: bool) -> None:
    # No rename on object stores: the manifest, written last, is the commit marker.
    store = ts.KvStore.open(location.kvstore, context=shared_context()).result()
    committed = store.read(MANIFEST_NAME).result().state == "value"
    if committed and not overwrite:
        raise CheckpointExistsError(f"A checkpoint already exists at {location}. Pass overwrite=True to replace it.")
    existing = store.list().result()
    if existing and not committed and not all(_is_array_key(k) for k in existing):
        raise CheckpointExistsError(
            f"{location} holds data that is not an eqxckpt checkpoint; refusing to replace it. Choose another path."
        )
    if committed:  # uncommit first, so a reader never sees the old manifest over new arrays
        store.delete_range(ts.KvStore.KeyRange(MANIFEST_NAME, MANIFEST_NAME + "\0")).result()
    if existing:  # the old checkpoint's arrays, or an interrupted save's
        store.delete_range(ts.KvStore.KeyRange()).result()
    _write_arrays(location, arrays, shared_context())
    store.write(MANIFEST_NAME, manifest.to_bytes()).result()


def _write(location: Location, manifest: Manifest, arrays, overwrite: bool) -> None:
    if location.local is not None:
        _write_local(location, manifest, arrays, overwrite)
    else:
        _write_object_store(location, manifest, arrays, overwrite)


def save(
    path: Any,
    tree: Any,
    *,
    metadata: dict | None = None,
    overwrite: bool = False,
    blocking: bool = True,
) -> SaveHandle:
    """Save a pytree as a checkpoint directory: one zarr3 array per array leaf.

    **Arguments:**

    - `path`: a local directory, a ``file://``/``memory://``/``s3://``/``gs://`` URL,
      or a TensorStore kvstore spec dict.
    - `tree`: any pytree (Equinox modules, optax states, dicts, lists...). Array
      leaves are stored at their key path (``model/layers/0/weight``); Python
      scalars and strings go into the manifest; other leaves (functions) are
      recorded by type and restored from ``like`` on load.
    - `metadata`: a JSON-serialisable dict stored with the checkpoint.
    - `overwrite`: replace an existing checkpoint (atomically on local disks).
    - `blocking`: if False, return once the arrays are copied to host memory
      and write in the background; call ``.wait()`` on the handle.

    **Returns:** a `SaveHandle` (already finished when ``blocking=True``).

    ```python
    model = eqx.nn.MLP(2, 2, 8, 2, key=jax.random.key(0))
    eqxckpt.save("ckpt/step_0", {"model": model}, metadata={"step": 0})
    ```
    """
    location = resolve(path)
    metadata = {} if metadata is None else metadata
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"metadata must be a JSON-serialisable dict: {e}") from None
    if not isinstance(metadata, dict):
        raise CheckpointError(f"metadata must be a dict, got {type(metadata).__name__}.")
    records, arrays = _plan(tree)
    manifest = Manifest(tuple(records), metadata)
    _check_target(location.local, overwrite)
    key = str(location)
    with _lock:
        previous = _in_flight.get(key)
    if previous is not None:
        previous._future.exception()  # wait; its error stays on its own handle
    # Async: snapshot to host now (a copy, since the caller may donate or
    # overwrite its buffers after we return); write later.
    host = [(rec, _host(value, copy=not blocking)) for rec, value in arrays]
    if blocking:
        future: concurrent.futures.Future = concurrent.futures.Future()
        _write(location, manifest, host, overwrite)
        future.set_result(None)
        return SaveHandle(key, future)
    handle = SaveHandle(key, _background().submit(_write, location, manifest, host, overwrite))
    with _lock:
        _in_flight[key] = handle
    handle._future.add_done_callback(lambda _: _forget(key, handle))
    return handle


def _forget(key: str, handle: SaveHandle) -> None:
    with _lock:
        if _in_flight.get(key) is handle and handle._future.exception() is None:
            del _in_flight[key]
