"""Key-level operations on an object store's kvstore, in one module: reads bounded
before they allocate, existence, listing, the conditional writes that commit a manifest
and create a key only if absent, and deleting a save's prefix or a leaf's keys. The
lease, holds and cleanup (`_lease`, `_holds`, `_reclaim`) and `ObjectStorage` touch keys
only through these.
"""

import re
import threading
from typing import Any

import tensorstore as ts

from .._errors import CheckpointChangedError, ManifestError
from .._manifest import MAX_MANIFEST_BYTES, check_checksum, parse_json_object
from .._paths import GROUP_METADATA, MANIFEST_NAME, group_file, group_locations, is_arrays_name


class SizeError(Exception):
    """A value is not of the size asked for: ``size`` is what it holds (None: more)."""

    def __init__(self, size: int | None):
        super().__init__(size)
        self.size = size


class PartError(Exception):
    """A value of the size asked for, of which a ranged read came back of another length."""


# The size a store reports when it refuses a byte range past a value's end ("... total
# size N" from S3 and Cloud Storage, "... of size N" from the memory store). A range
# refused without one (S3's and Cloud Storage's 416) starts past the end of an empty value.
_REFUSED_SIZE = re.compile(r"\bsize (\d+)\b")


def _refused(error: BaseException) -> bool:
    return isinstance(error, ValueError) and str(error).startswith("OUT_OF_RANGE")


# The most bytes one request reads of a chunk: a large chunk is read as ranges of this
# size at once, each its own connection (a store serves one connection at a fraction of
# the network's speed).
PART_BYTES = 8 << 20
# The least a part holds where a small host memory budget makes parts smaller.
MIN_PART_BYTES = 1 << 20


def read_exact(store: ts.KvStore, key: str, size: int) -> ts.Future:
    """Start reading ``key`` if it holds exactly ``size`` bytes, downloading no more than that.

    Two ranged reads at once: ``[0, size)`` (refused if the value is smaller) and the
    one byte after it (found only if it is larger). The future's result is the read
    result (state ``missing`` if absent); its exception a `SizeError` if the value is
    of another size.
    """
    promise, future = ts.Promise.new()

    def settle(parts: ts.Future) -> None:
        try:
            promise.set_result(parts.result()[0])
        except Exception as e:  # noqa: BLE001 - handed to the reader
            promise.set_exception(e)

    read_parts(store, key, size, max(1, size)).add_done_callback(settle)
    return future


def read_parts(
    store: ts.KvStore, key: str, size: int, part_bytes: int, start: int = 0, stop: int | None = None
) -> ts.Future:
    """Start reading bytes ``[start, stop)`` (by default all) of ``key`` if it holds exactly
    ``size`` bytes, as ranges of at most ``part_bytes`` all in flight at once, downloading
    no more than those bytes (and one).

    The ranges ``[start, start + part_bytes)``, ... up to ``stop`` (each refused if the
    value ends before it does) and, where ``stop`` is ``size``, the one byte after it
    (found only if the value is larger). The future is done once every one of them is;
    its result is their read results, in order (state ``missing`` if absent; a value
    replaced in between gives results of different generations); its exception a
    `SizeError` if the value is of another size.
    """
    promise, future = ts.Promise.new()
    stop = size if stop is None else stop
    starts = range(start, stop, part_bytes) if stop > start else range(start, start + 1)
    reads = [store.read(key, byte_range=slice(at, min(at + part_bytes, stop))) for at in starts]
    beyond = store.read(key, byte_range=slice(size, size + 1)) if stop == size else None

    def settle() -> None:  # once all are done
        try:
            results = []
            for read in reads:
                try:
                    results.append(read.result())
                except ValueError as e:
                    if not _refused(e):
                        raise
                    match = _REFUSED_SIZE.search(str(e))
                    if match is None and read is not reads[0]:
                        continue  # a range past the end of a shorter value: the first says its size
                    if match is not None and int(match[1]) == size:
                        # The value is the size asked for, but a range of it came back
                        # another length: the store (or something between) answered wrongly.
                        raise PartError(f"a ranged read of {key} returned another length than asked for") from None
                    raise SizeError(int(match[1]) if match else 0) from None
            if len(results) < len(reads):  # refused ranges past the end, and none said the size
                raise SizeError(start + _shorter(reads))
            if beyond is not None and any(result.state == "value" for result in results):
                try:
                    if beyond.result().state == "value":
                        raise SizeError(None)
                except ValueError as e:
                    if not _refused(e):
                        raise
            promise.set_result(results)
        except Exception as e:  # noqa: BLE001 - handed to the reader
            promise.set_exception(e)

    every = [*reads, *([] if beyond is None else [beyond])]
    left, lock = [len(every)], threading.Lock()

    def one(_: ts.Future) -> None:  # on TensorStore's threads
        with lock:
            left[0] -= 1
            last = not left[0]
        if last:
            settle()

    for read in every:
        read.add_done_callback(one)
    return future


def _shorter(reads: list[ts.Future]) -> int:
    """The size of a value of which the first ``reads`` (ranges from 0) found only some: the
    bytes they found before the first refused one."""
    found = 0
    for read in reads:
        try:
            found += len(read.result().value)
        except ValueError:
            return found
    return found


def read_bounded_future(store: ts.KvStore, key: str, cap: int, attempts: int = 4) -> ts.Future:
    """Start reading ``key``, downloading at most ``cap + 1`` bytes of it (more: the
    caller refuses it); the future's result is the read result.

    A ranged read past the end of a smaller value (the usual case) is refused with its
    size, which is then read exactly (`read_exact`): no read ever downloads more than it
    asked for, even if the value is replaced in between (then it is read again).
    """
    promise, future = ts.Promise.new()

    def start(left: int) -> None:
        first = store.read(key, byte_range=slice(0, cap + 1))

        def on_first(done: ts.Future) -> None:
            try:
                promise.set_result(done.result())
                return
            except ValueError as e:
                if not _refused(e):
                    promise.set_exception(e)
                    return
                match = _REFUSED_SIZE.search(str(e))
            except Exception as e:  # noqa: BLE001 - handed to the reader
                promise.set_exception(e)
                return
            read_exact(store, key, int(match[1]) if match else 0).add_done_callback(on_exact)

        def on_exact(done: ts.Future) -> None:
            try:
                promise.set_result(done.result())
            except SizeError:
                if left > 1:
                    start(left - 1)  # replaced in between: read it again
                else:
                    promise.set_exception(
                        CheckpointChangedError(f"{key} changed size {attempts} times while it was read; try again.")
                    )
            except Exception as e:  # noqa: BLE001 - handed to the reader
                promise.set_exception(e)

        first.add_done_callback(on_first)

    start(attempts)
    return future


def read_bounded(store: ts.KvStore, key: str, cap: int) -> Any:
    """Read ``key``, downloading at most ``cap + 1`` bytes of it (`read_bounded_future`)."""
    return read_bounded_future(store, key, cap).result()


def stat(store: ts.KvStore, key: str) -> Any:
    """Whether ``key`` exists, and its generation, without downloading it."""
    return stat_future(store, key).result()


def stat_future(store: ts.KvStore, key: str) -> ts.Future:
    """`stat` started: many of them run together (one metadata request each, a HEAD on S3)."""
    return store.read(key, byte_range=slice(0, 0))


def exists(store: ts.KvStore, key: str) -> bool:
    return stat(store, key).state == "value"


def list_keys(store: ts.KvStore, prefix: str = "") -> list[str]:
    """The keys of ``store`` that start with ``prefix`` (every key: ""), decoded."""
    if not prefix:
        listed = store.list()
    else:  # the keys from ``prefix`` up to, not including, the next string of its length
        listed = store.list(ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1)))
    return [key.decode("utf-8", "replace") for key in listed.result()]


def committed_arrays(store: ts.KvStore) -> str | None:
    """The arrays prefix the manifest at the root names ("" if none, or no manifest);
    None if a manifest is there that eqxckpt cannot read (then nothing is garbage)."""
    top = read_bounded(store, MANIFEST_NAME, MAX_MANIFEST_BYTES)
    if top.state != "value":
        return ""
    try:
        raw = bytes(top.value)
        doc = parse_json_object(raw, MANIFEST_NAME)  # size and density checked before parsing
        check_checksum(raw, doc, MANIFEST_NAME)  # a flipped bit must not name another prefix
    except ManifestError:
        return None
    arrays = doc.get("arrays", "")
    return arrays if arrays == "" or is_arrays_name(arrays) else None


def write_manifest(store: ts.KvStore, raw: bytes, base: bytes) -> bool:
    """Write the manifest ``raw`` (the commit) on condition that the manifest is still
    ``base``; True if ``raw`` is the committed manifest now (written here, or before)."""
    if store.write(MANIFEST_NAME, raw, if_equal=base).result().generation:
        return True
    # The condition failed: done already (by the save itself, or by a cleanup), or not at all.
    top = read_bounded(store, MANIFEST_NAME, MAX_MANIFEST_BYTES)
    return top.state == "value" and bytes(top.value) == raw


def create_if_absent(store: ts.KvStore, key: str, raw: bytes) -> bool:
    """Write ``raw`` at ``key`` only if no value is there (the condition a lease is taken
    with: the generation of a read that found none); True if this call wrote it."""
    found = stat(store, key)
    if found.state == "value":
        return False
    return bool(store.write(key, raw, if_equal=found.stamp.generation).result().generation)


def delete_leaf_keys(store: ts.KvStore, paths: list[str]) -> None:
    """Delete what eqxckpt writes for each leaf (its ``zarr.json`` and chunk keys), then
    the zarr group files above them that hold exactly what eqxckpt writes; nothing else.
    (Checkpoints written before saves had prefixes of their own keep their arrays here.)"""
    if not paths:
        return
    futures = []
    for path in paths:
        futures.append(store.delete_range(ts.KvStore.KeyRange(f"{path}/zarr.json", f"{path}/zarr.json\0")))
        futures.append(store.delete_range(ts.KvStore.KeyRange(f"{path}/c", f"{path}/c\0")))  # a 0-d array's chunk
        futures.append(store.delete_range(ts.KvStore.KeyRange(f"{path}/c/", f"{path}/c0")))
    for future in futures:
        future.result()
    keys = [group_file(group) for group in group_locations(paths)]
    reads = [(key, read_exact(store, key, len(GROUP_METADATA))) for key in keys]
    deletes = []
    for key, read in reads:
        try:
            found = read.result()
        except SizeError:
            continue  # not what eqxckpt writes
        if found.state == "value" and bytes(found.value) == GROUP_METADATA:  # unchanged since eqxckpt wrote it
            deletes.append(store.write(key, None, if_equal=found.stamp.generation))
    for future in deletes:
        try:
            future.result()
        except ValueError:  # changed meanwhile (by someone else): not ours to delete any more
            pass


# The keys eqxckpt writes in a save's own prefix, by their names: zarr metadata and chunks
# (its arrays and groups), its commit mark, other saves' holds on it, its marks. Anything
# else there (a user's file) is not eqxckpt's to delete.
_OURS = re.compile(r"(?:[^/]+/)*(?:zarr\.json|c(?:/\d+)*)|eqxckpt\.commit\.json|%holds/.+|%doomed|%retired")


def delete_ours(store: ts.KvStore, name: str, but: tuple[str, ...] = ()) -> None:
    """Delete the keys of the prefix ``name`` that eqxckpt writes (`_OURS`), but ``but``
    (names in it, deleted later); keys of any other name are left as they are."""
    keys = [key for key in list_keys(store, f"{name}/") if _OURS.fullmatch(key[len(name) + 1 :]) and key not in but]
    for future in [store.write(key, None) for key in keys]:
        future.result()


def delete_arrays(store: ts.KvStore, names: list[str]) -> None:
    """Delete saves' own prefixes (``%arrays.<hex>/``): the keys eqxckpt wrote there
    (`delete_ours`). Only for prefixes that were never committed (no save refers to those);
    committed ones are deleted by `delete_unheld`."""
    for name in names:
        delete_ours(store, name)
