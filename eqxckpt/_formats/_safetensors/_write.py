"""`save_safetensors`: a pytree's arrays as one safetensors file, or as HuggingFace's
sharded layout (shard files, then ``model.safetensors.index.json``, the commit),
written by one process or by every process of a multi-process job.

With several processes each shard file is written by one process (`assign`), from
the blocks of its tensors that it holds and those the processes holding them send it
(`Transfers`, the local tier's point-to-point transport: their own device arrays, no
copies), a round of files at a time and a wave of each file's tensors at a time: a
writer holds two waves of what it was sent and a band of rows beside its own arrays,
never its whole file. What the processes agree on (the tree, which arrays are global,
the plan) goes through `Phases`, as a save's does.
"""

import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pathlib
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._arguments import checked_arguments
from ..._distributed import Phases, is_multiprocess
from ..._dtypes import little_endian
from ..._errors import CheckpointError, CheckpointExistsError, CheckpointWriteError, PathError, UnsupportedLeafError
from ..._leaf import UNKNOWN, ArrayLeaf
from ..._paths import MANIFEST_NAME, check_one_tree, key_entry_record
from ..._progress import Progress, advance, reporting
from ..._read._lazy import LazyArray
from ..._read._place import Block, block_holders, region_of, slice_key
from ..._storage import Storage, resolve
from ..._tree import flatten, is_prng_key_dtype
from ..._write._shares import global_leaves
from ._layout import (
    DTYPES,
    INDEX_NAME,
    MAX_HEADER_BYTES,
    NAMES,
    SINGLE_NAME,
    SUB_BYTE,
    TensorEntry,
    file_header,
    index_document,
    parse_size,
    shard_names,
    split,
)
from ._read import name_to_keys

if TYPE_CHECKING:  # JAX is imported where a tree is saved, not to read a file
    from jaxtyping import PyTree

    from ..._local._peers import Transfers


# What a writer is sent at a time: the blocks of this many bytes of its file's tensors
# (in the file's order), fetched while the waves before are written, this many ahead.
WAVE_BYTES = 64 << 20
WAVES_AHEAD = 2


@dataclasses.dataclass
class _Tensor:
    """One array leaf as a tensor of the files: its path, its entry in a header, its
    value, and where its bytes are: for a global array, each distinct block and the
    processes holding it; None: held whole by each process (process 0's copy is written)."""

    path: str
    entry: TensorEntry
    value: Any
    holders: dict[Block, tuple[int, ...]] | None = None

    def held(self, process: int) -> int:
        """Bytes of it that ``process`` holds."""
        if self.holders is None:
            return self.entry.nbytes if process == 0 else 0
        itemsize = np.dtype(DTYPES[self.entry.dtype]).itemsize
        return sum(_block_bytes(b, itemsize) for b, who in self.holders.items() if process in who)

    def needed(self, process: int) -> list[tuple[Block | None, int]]:
        """What ``process`` must be sent to write it: each block it lacks (None: all of it)
        with the process that sends it, spread over the holders of each block."""
        if self.holders is None:
            return [] if process == 0 else [(None, 0)]
        return [
            (block, who[n % len(who)])
            for n, (block, who) in enumerate(sorted(self.holders.items()))
            if process not in who
        ]


# The blocks a writer was sent, by tensor path and block (None: the whole tensor).
Received = dict[tuple[str, Block | None], np.ndarray]


def _block_bytes(block: Block, itemsize: int) -> int:
    return math.prod(stop - start for start, stop in block) * itemsize


@checked_arguments
def save_safetensors(
    path: str | os.PathLike[str] | dict[str, Any],
    tree: "PyTree",
    *,
    max_shard_size: int | str | None = None,
    names: Callable[[str], str] | Mapping[str, str] | None = None,
    metadata: dict[str, str] | None = None,
    overwrite: bool = False,
    progress: Progress = "auto",
) -> None:
    """Write a pytree's arrays as one safetensors file, or as HuggingFace's sharded
    layout, atomically; from one process, or from every process of a job.

    Tensor names are the leaves' paths with ``/`` turned into ``.``
    (``layers/0/weight`` is ``layers.0.weight``), or what ``names`` gives, so
    the files load in `safetensors`, in ``transformers`` and back through
    `eqxckpt.load`. Each file holds its tensors as ``safetensors.numpy.save_file``
    lays them out (byte for byte, with one metadata key or none).

    **Arguments:**

    - `path`: without `max_shard_size`, the ``.safetensors`` file to write (a local
      path). With it, the directory (a local path, or an ``s3://``/``gs://`` URL or
      kvstore spec, as for `eqxckpt.save`) that gets the shards,
      ``model-00001-of-0000N.safetensors``..., and last
      ``model.safetensors.index.json``, the commit: a directory without its index
      is not a model. (A model that fits one shard is ``model.safetensors`` alone,
      as HuggingFace writes it.)
    - `tree`: a pytree whose leaves are arrays (other leaves are refused: a
      safetensors file holds tensors only; filter them out first with
      ``eqx.filter(tree, eqx.is_array)``). Lazy arrays of an opened checkpoint
      (``eqxckpt.open(src).tree()``) are read one at a time while writing. Arrays
      of any byte order are written little-endian, as safetensors' data are.
    - `max_shard_size`: the most bytes of tensors in one shard, an int or a string
      such as ``"5GB"``; tensors are split into shards as ``huggingface_hub``
      splits a state dict (in the tree's order; a tensor over the limit is a shard
      on its own).
    - `names`: each leaf's tensor name, from its path: a function, or a mapping
      that names every leaf. Two leaves with one name are refused, naming both.
    - `metadata`: string-to-string metadata: every file's ``__metadata__`` (and the
      index's ``metadata``, after ``total_size``); None writes none, ``{}`` an empty
      one, as the `safetensors` library does.
    - `overwrite`: replace a model already there. It first removes the old index
      and, for a sharded model, an old ``model.safetensors`` (so no reader takes
      the old model for the new one meanwhile), then replaces the files the new
      model writes; an old shard the new model does not write is left, with a
      warning naming it. Without it, nothing there is touched:
      `CheckpointExistsError`. A writer of a sharded model holds the directory
      while it writes (another is refused: `CheckpointBusyError`), and the index
      is written only over files that are still the ones this call wrote.
    - `progress`: as for `eqxckpt.save` (``"auto"``: a bar on a terminal for a
      large or slow write; True: always on a terminal; a callable is called with
      ``(bytes_done, bytes_total, leaves_done, leaves_total)``).

    With several JAX processes (``jax.process_count() > 1``), every process calls it
    with the same arguments and the same tree of global arrays (processes that ask
    for different models all raise before anything is written). Each shard file is
    written by one process, the processes sharing the files evenly and each writing
    those it holds most of; a process is sent only the blocks of its files' tensors
    it does not hold, about 64 MiB at a time, never its whole file. Process 0 writes
    the index once every file is complete, and only where it sees every file (a
    directory every process shares, or an object store). Arrays that are not global
    (numpy arrays) are written from process 0's copy.

    **Returns:** nothing; the file (the directory) is complete and durable on return.

    ```python
    eqxckpt.save_safetensors("model.safetensors", eqx.filter(model, eqx.is_array))
    params = safetensors.numpy.load_file("model.safetensors")
    eqxckpt.save_safetensors("my-model", params, max_shard_size="5GB")
    ```
    """
    if is_multiprocess():  # every check in a phase: one process's refusal is every process's
        _publish_together(path, tree, max_shard_size, names, metadata, overwrite, progress)
        return
    publishing = _Publishing.at(path, max_shard_size, metadata, overwrite)
    if not overwrite and publishing.taken():  # fail fast, before reading anything; checked again at the end
        raise publishing.exists_error()
    publishing.plan(_tensors(tree, names), 1)
    with (
        publishing.held(),
        reporting(f"writing {publishing.where}", publishing.total_bytes, publishing.count, progress),
    ):
        publishing.prepare()
        stamps = {}
        for shard in range(len(publishing.files)):
            stamps.update(publishing.write(shard))
        publishing.commit(stamps)


class _Publishing:
    """One model being written: where (`storage`, and the file name without shards),
    its files and which process writes each (`plan`), and the steps of writing them."""

    def __init__(self, storage: Storage, single: str | None, limit: int | None, metadata: dict | None, overwrite: bool):
        self.storage, self.single, self.limit = storage, single, limit
        self.metadata, self.overwrite = metadata, overwrite
        self.where = str(storage) if single is None else os.path.join(str(storage), single)
        self.files: list[tuple[str, list[_Tensor]]] = []
        self.writers: list[int] = []
        # Each file's stamp when process 0 took the directory ("" none): writes are made on
        # condition that it is still so (`Storage.put_file`'s ``seen``).
        self.seen: dict[str, str] = {}

    @classmethod
    def at(
        cls, path: Any, max_shard_size: int | str | None, metadata: dict[str, str] | None, overwrite: bool
    ) -> "_Publishing":
        """The model `save_safetensors` is asked to write, its arguments checked."""
        if metadata is not None:
            metadata = dict(metadata)
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
                raise CheckpointError("safetensors metadata must map strings to strings.")
            for text in (t for item in metadata.items() for t in item):
                _utf8(text, f"metadata {text!r:.100}")
        limit = None if max_shard_size is None else parse_size(max_shard_size)
        if limit is not None and metadata and "total_size" in metadata:
            raise CheckpointError(
                "metadata may not hold 'total_size': the index's metadata holds the model's total size under that name."
            )
        if limit is None:
            if isinstance(path, dict) or "://" in os.fspath(path):
                raise CheckpointError(
                    f"save_safetensors writes one file to a local path; {path!r:.200} is not one. Pass max_shard_size "
                    "to write a sharded directory to an object store."
                )
            final = pathlib.Path(path).absolute()
            if final.is_dir():
                raise CheckpointError(
                    f"Cannot write {final}: it is a directory (pass max_shard_size for a sharded one)."
                )
            storage, single = resolve(final.parent), final.name
        else:
            storage, single = resolve(path), None
        if (checkpoint := _checkpoint_around(storage)) is not None:
            raise CheckpointError(
                f"{storage} is in the eqxckpt checkpoint {checkpoint} (it holds {MANIFEST_NAME}): a model written "
                "into it would be files the checkpoint does not know. Write it elsewhere. Nothing was written."
            )
        return cls(storage, single, limit, metadata, overwrite)

    def held(self) -> contextlib.AbstractContextManager[None]:
        """The directory held against other writers (`Storage.publishing`) while a sharded
        model is written; one file, atomic on its own, holds nothing (its neighbours are
        other writers' to write)."""
        return self.storage.publishing() if self.single is None else contextlib.nullcontext()

    def call(self) -> list[Any]:
        """What every process must have asked for: where, how split, the metadata, overwrite."""
        return [self.where, self.single, self.limit, self.metadata, self.overwrite]

    def plan(self, tensors: list[_Tensor], processes: int) -> None:
        """Split ``tensors`` into files and choose the process writing each."""
        if self.single is not None:
            shards = [list(range(len(tensors)))]
            file_names = [self.single]
        else:
            shards = split([t.entry.nbytes for t in tensors], self.limit or 1) or [[]]
            file_names = shard_names(len(shards))
        self.files = [(name, [tensors[i] for i in shard]) for name, shard in zip(file_names, shards)]
        for name, ts in self.files:  # every header can be written and read, before anything is
            head, _ = file_header([t.entry for t in ts], self.metadata)
            if len(head) - 8 > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"{name}'s header would be {len(head) - 8} bytes, over the {MAX_HEADER_BYTES} that safetensors "
                    "(and eqxckpt) read: shorter names, fewer tensors a file (max_shard_size), or less metadata. "
                    "Nothing was written."
                )
        if self.single is not None:  # one file, where process 0 would find it
            self.writers = [0]
            return
        self.writers = assign([[sum(t.held(p) for t in ts) for p in range(processes)] for _, ts in self.files])

    def mine(self, process: int) -> list[int]:
        return [i for i, writer in enumerate(self.writers) if writer == process]

    @property
    def total_bytes(self) -> int:
        return sum(t.entry.nbytes for _, ts in self.files for t in ts)

    @property
    def count(self) -> int:
        return sum(len(ts) for _, ts in self.files)

    def fingerprint(self) -> str:
        """What every process must agree on: the call, the files, their tensors and where
        each is held."""
        doc = [self.call()] + [
            [name, writer, [[t.path, t.entry.name, t.entry.dtype, t.entry.shape, _holders_json(t)] for t in ts]]
            for (name, ts), writer in zip(self.files, self.writers)
        ]
        return hashlib.sha256(json.dumps(doc).encode()).hexdigest()

    def summary(self) -> str:
        limit = "one file" if self.single is not None else f"shards of at most {self.limit} bytes"
        return (
            f"{self.count} tensors of {self.total_bytes} bytes in {len(self.files)} files at {self.where} "
            f"({limit}, overwrite={self.overwrite}, metadata {self.metadata})"
        )

    # -- the steps ---------------------------------------------------------------------

    def _layout_names(self) -> list[str]:
        """The names a model here is found by: its single file or index, and the new files."""
        return [*{INDEX_NAME, SINGLE_NAME, *(name for name, _ in self.files)}] if self.single is None else [self.single]

    def taken(self) -> list[str]:
        return [name for name in sorted(self._layout_names()) if self.storage.file_exists(name)]

    def exists_error(self) -> CheckpointExistsError:
        return CheckpointExistsError(
            f"{self.where} already holds {', '.join(self.taken()) or 'a model'}; pass overwrite=True to replace it, "
            "or write elsewhere."
        )

    def prepare(self) -> str:
        """Process 0, holding the directory, before any file is written: refuse a model
        there (without ``overwrite``), else uncommit it: its index (and, for a sharded
        model, a single file) goes first, so no reader mixes the old model with the new.

        **Returns:** `seen`, as JSON, for every process."""
        self._uncommit()
        if self.single is None:
            self.seen = {n: self.storage.file_stamp(n) or "" for n in [INDEX_NAME, *(n for n, _ in self.files)]}
        return json.dumps(self.seen)

    def _uncommit(self) -> None:
        if self.single is not None:
            if not self.overwrite and self.taken():
                raise self.exists_error()
            return
        if not self.overwrite:
            if self.taken():
                raise self.exists_error()
            return
        old = self._old_files()
        self.storage.remove_file(INDEX_NAME)
        if len(self.files) > 1:
            self.storage.remove_file(SINGLE_NAME)
        left = sorted(set(old) - {name for name, _ in self.files} - {SINGLE_NAME})
        if left:
            from ..._errors import warn_at_caller

            warn_at_caller(
                f"{self.where}: the model replaced had files the new one does not write, left where they are "
                f"(no index names them now): {', '.join(left[:10])}. Remove them before publishing the directory."
            )

    def _old_files(self) -> list[str]:
        """The files the index of the model there names (none if it has no readable index)."""
        try:
            raw = self.storage.read_small(INDEX_NAME, 64 << 20)
            weight_map = json.loads(raw or b"{}").get("weight_map", {})
            return sorted({v for v in weight_map.values() if isinstance(v, str)})
        except (OSError, ValueError, AttributeError):
            return []

    def waves(self, shard: int) -> list[list[_Tensor]]:
        """File ``shard``'s tensors in the order its data holds them, in waves of about
        `WAVE_BYTES`: what its writer is sent at a time."""
        _, tensors = self.files[shard]
        by_name = {t.entry.name: t for t in tensors}
        waves: list[list[_Tensor]] = [[]]
        size = 0
        for entry in file_header([t.entry for t in tensors], self.metadata)[1]:
            if waves[-1] and size + entry.nbytes > WAVE_BYTES:
                waves.append([])
                size = 0
            waves[-1].append(by_name[entry.name])
            size += entry.nbytes
        return waves

    def write(self, shard: int, fetch: "Callable[[int], Received] | None" = None) -> dict[str, str]:
        """Write file ``shard`` whole, from this process's arrays and the blocks other
        processes send it: ``fetch(k)``, those of wave ``k`` (`waves`), fetched while the
        wave before it is written.

        **Returns:** ``{name: stamp}`` of the file written (`Storage.file_stamp`)."""
        name, tensors = self.files[shard]
        head, _ = file_header([t.entry for t in tensors], self.metadata)
        waves = self.waves(shard)

        def pieces() -> Iterator[Any]:
            yield head
            with contextlib.ExitStack() as held:
                for source in {
                    id(t.value.source): t.value.source for t in tensors if isinstance(t.value, LazyArray)
                }.values():
                    held.enter_context(source.consistent())
                ahead = held.enter_context(concurrent.futures.ThreadPoolExecutor(1)) if fetch else None
                coming: collections.deque[concurrent.futures.Future[Received]] = collections.deque()
                band = _Band()
                for k, wave in enumerate(waves):
                    # The next `WAVES_AHEAD` waves are on their way while this one is written.
                    while ahead is not None and fetch is not None and len(coming) <= WAVES_AHEAD:
                        if (next_wave := k + len(coming)) >= len(waves):
                            break
                        coming.append(ahead.submit(fetch, next_wave))
                    received = coming.popleft().result() if coming else {}
                    for tensor in wave:
                        for piece in _tensor_pieces(tensor, received, band):
                            yield np.ascontiguousarray(piece).reshape(-1).view(np.uint8).data
                        advance(tensor.entry.nbytes)
                    del received

        try:
            return {name: self.storage.put_file(name, pieces(), self.overwrite, self.seen.get(name))}
        except CheckpointError:
            raise
        except OSError as e:
            after = (
                "Nothing was written."
                if self.single is not None or len(self.files) == 1
                else "No index was written, so the directory holds no model: rerun with overwrite=True."
            )
            raise CheckpointWriteError(f"Writing {name} in {self.storage} failed: {e.strerror or e}. {after}") from e

    def commit(self, stamps: dict[str, str]) -> None:
        """Process 0, once every file is complete: the index, written last (none for a
        model of one file, which is its own commit), only if every file is still the one
        this job wrote (``stamps``: each file's, as its writer wrote it)."""
        if self.single is not None or len(self.files) < 2:
            return
        missing = [name for name, _ in self.files if not self.storage.file_exists(name)]
        if missing:  # written by other processes somewhere this one does not see
            raise CheckpointWriteError(
                f"{self.where}: process 0 does not find {', '.join(missing[:5])}, which other processes wrote there: "
                "the directory is not one file system shared by every process. Publish to a shared file system or "
                "an object store (s3://, gs://). No index was written."
            )
        replaced = [name for name, _ in self.files if self.storage.file_stamp(name) != stamps.get(name)]
        if replaced:
            raise CheckpointWriteError(
                f"{self.where}: {', '.join(replaced[:5])} changed after this job wrote them: another writer is writing "
                "there too, or the directory is not one file system shared by every process. No index was written; "
                "write the model again when the other writer is done, or elsewhere."
            )
        files = {name: [t.entry for t in ts] for name, ts in self.files}
        self.storage.put_file(
            INDEX_NAME, [index_document(files, self.metadata or {})], self.overwrite, self.seen.get(INDEX_NAME)
        )


def _checkpoint_around(storage: Storage) -> str | None:
    """The eqxckpt checkpoint that ``storage``'s directory is, or is inside (one that
    holds a manifest), or None."""
    if (local := storage.local) is not None:
        return next((str(p) for p in (local, *local.parents) if (p / MANIFEST_NAME).exists()), None)
    spec = dict(storage.kvstore)
    parts = [part for part in str(spec.get("path", "")).split("/") if part]
    for end in range(len(parts), -1, -1):
        around = resolve({**spec, "path": "/".join(parts[:end])})
        if around.file_exists(MANIFEST_NAME):
            return str(around)
    return None


def _holders_json(tensor: _Tensor) -> Any:
    return (
        None if tensor.holders is None else sorted([list(map(list, b)), list(who)] for b, who in tensor.holders.items())
    )


def assign(held: list[list[int]]) -> list[int]:
    """The process writing each file, given ``held[f][p]``, the bytes of file ``f`` that
    process ``p`` holds: the files are shared evenly (each process writes at most
    ``ceil(files / processes)``), the largest first, each by the process with room that
    holds most of it (ties: the one writing fewest, then the lowest index).

    ```python
    assign([[10, 0], [10, 0], [0, 10]])  # [0, 1, 1]: process 0 holds files 0 and 1, but writes one
    ```
    """
    if not held:
        return []
    processes = len(held[0])
    room = -(-len(held) // processes)
    load = [0] * processes
    writers = [0] * len(held)
    for f in sorted(range(len(held)), key=lambda f: (-sum(held[f]), f)):
        open_ = [p for p in range(processes) if load[p] < room]
        writer = max(open_, key=lambda p: (held[f][p], -load[p], -p))
        writers[f] = writer
        load[writer] += 1
    return writers


def _tensors(tree: "PyTree", names: Callable[[str], str] | Mapping[str, str] | None) -> list[_Tensor]:
    """Each array leaf of ``tree`` as a tensor, named and checked: what a file cannot hold,
    or names that collide or would not read back as a tree, are refused here."""
    import jax

    flat, _ = flatten(tree)
    tensors: list[_Tensor] = []
    if isinstance(names, Mapping):
        unnamed = [p for p, _, leaf in flat if leaf is not None and p not in names]
        if unnamed:
            raise PathError(
                f"names maps leaf paths to tensor names but leaves no name for {len(unnamed)} leaves "
                f"(e.g. {unnamed[0]!r}). Name every leaf, or pass a function."
            )
    taken: dict[str, str] = {}  # tensor name -> leaf path
    for leaf_path, keypath, leaf in flat:
        if leaf is None:
            continue
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic, LazyArray)):
            raise CheckpointError(
                f"Leaf {leaf_path!r} is {type(leaf).__name__}, not an array: a safetensors file holds tensors only. "
                "Filter the tree first (eqx.filter(tree, eqx.is_array))."
            )
        name = _name(leaf_path, keypath, names)
        if name in taken:
            raise PathError(
                f"Leaves {taken[name]!r} and {leaf_path!r} would both be the tensor {name!r}: a file holds one tensor "
                "of a name. Give them different names."
            )
        taken[name] = leaf_path
        if is_prng_key_dtype(leaf.dtype):
            raise UnsupportedLeafError(
                f"Leaf {leaf_path!r} is a typed PRNG key array, which safetensors cannot hold. Save its key data "
                "(jax.random.key_data(x)) instead, or use eqxckpt.save, which stores keys."
            )
        dtype = NAMES.get(np.dtype(leaf.dtype).name)
        if dtype is None:
            packed = {v: k for k, v in SUB_BYTE.items()}.get(np.dtype(leaf.dtype).name)
            why = (
                f"which safetensors holds only packed several to a byte ({packed}), and eqxckpt does not write that"
                if packed
                else "which safetensors cannot hold"
            )
            raise CheckpointError(
                f"Leaf {leaf_path!r} has dtype {leaf.dtype}, {why}. Save it with eqxckpt.save, or store its bytes "
                "as uint8 (x.view(jnp.uint8)) and its dtype in the metadata."
            )
        tensors.append(_Tensor(leaf_path, TensorEntry(name, dtype, tuple(int(n) for n in leaf.shape)), leaf))
    _check_reads_back(tensors)
    return tensors


def _name(leaf_path: str, keypath: Any, names: Callable[[str], str] | Mapping[str, str] | None) -> str:
    """A leaf's tensor name: ``names``' (checked), else its keys joined by ``.``."""
    if names is None:
        # Keys that hold dots (a state dict's names) are kept as they are: two leaves
        # that meet at one name are refused by the caller.
        name = ".".join(str(key_entry_record(entry)[1]) for entry in keypath)
    else:
        try:
            name = names[leaf_path] if isinstance(names, Mapping) else names(leaf_path)
        except Exception as e:  # the caller's function: its failure, named, as every process's
            raise PathError(f"names failed for leaf {leaf_path!r}: {type(e).__name__}: {e}") from e
        if not isinstance(name, str) or not name:
            raise PathError(f"names gives leaf {leaf_path!r} the name {name!r:.100}; a tensor name is a non-empty str.")
    if name == "__metadata__":
        raise PathError(
            f"Leaf {leaf_path!r} would be the tensor '__metadata__', the name safetensors reserves for the "
            "file's metadata (no reader could open the file). Rename the key."
        )
    _utf8(name, f"Leaf {leaf_path!r}'s tensor name {name!r:.100}")
    if "" in name.split("."):
        raise PathError(
            f"Leaf {leaf_path!r} would be the tensor {name!r}, with an empty part between dots, which no reader "
            "maps back onto a tree. Name it without one."
        )
    return name


def _utf8(text: str, what: str) -> None:
    """Refuse text a file's header cannot hold: JSON in UTF-8 has no lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PathError(
            f"{what} is not valid Unicode (a lone surrogate): a safetensors header cannot hold it."
        ) from None


def _check_reads_back(tensors: list[_Tensor]) -> None:
    """Refuse names that `eqxckpt.load` would not read back as one tree (a name that is
    both a tensor and a prefix of others: ``a`` and ``a.b``)."""
    leaves = {}
    for tensor in tensors:
        path, keys = name_to_keys(tensor.entry.name)
        leaves[path] = ArrayLeaf(path, keys, tensor.entry.shape, DTYPES[tensor.entry.dtype], UNKNOWN)
    by_path = {name_to_keys(t.entry.name)[0]: t for t in tensors}
    try:
        check_one_tree(leaves, "the files", lambda path: by_path[path].entry.name)
    except CheckpointError as e:
        raise PathError(f"The tensor names would not read back as one tree: {e} Rename one of them.") from None


# A tensor whose blocks split its rows' columns is put together this many bytes of rows
# at a time, in C order: what a file's writer holds beyond the blocks it was sent.
BAND_BYTES = 64 << 20


class _Band:
    """One buffer that a file's bands of rows are put together in, in turn: a fresh one
    per band would cost a page fault per page (on a VM, often one in its host too)."""

    def __init__(self) -> None:
        self._buffer = np.empty(0, np.uint8)

    def of(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        nbytes = math.prod(shape) * dtype.itemsize
        if self._buffer.size < nbytes:
            self._buffer = np.empty(nbytes, np.uint8)
        return self._buffer[:nbytes].view(dtype).reshape(shape)


def _tensor_pieces(tensor: _Tensor, received: Received, band: _Band | None = None) -> Iterator[np.ndarray]:
    """A tensor's values as its file holds them (little-endian, C order), in pieces: this
    process's own array, or its blocks (its own and ``received``) in order where they
    split its rows only, else bands of rows put together from them (in ``band``, reused
    for the next once the writer has taken the last: `Storage.put_file`'s pieces)."""
    if (whole := received.get((tensor.path, None))) is not None:
        yield whole
        return
    value = tensor.value
    if isinstance(value, LazyArray):
        yield _stored(value.get())
        return
    if tensor.holders is None:
        yield _stored(value)
        return
    shape, dtype = tensor.entry.shape, np.dtype(DTYPES[tensor.entry.dtype])
    blocks = sorted(tensor.holders)

    def data(block: Block) -> np.ndarray:
        got = received.get((tensor.path, block))
        return _local_block(tensor, block) if got is None else got

    if not shape or all(block[1:] == _whole(tensor)[1:] for block in blocks):  # whole rows: in order
        for block in blocks:
            yield data(block)
        return
    row = math.prod(shape[1:]) * dtype.itemsize
    step = max(1, BAND_BYTES // max(1, row))
    band = _Band() if band is None else band
    for start in range(0, shape[0], step):
        stop = min(shape[0], start + step)
        rows = band.of((stop - start, *shape[1:]), dtype)
        for block in blocks:
            (a, b), rest = block[0], block[1:]
            low, high = max(a, start), min(b, stop)
            if low < high:
                rows[(slice(low - start, high - start), *region_of(rest))] = data(block)[low - a : high - a]
        yield rows


def _dtype(tensor: _Tensor) -> np.dtype:
    return np.dtype(DTYPES[tensor.entry.dtype])


def _whole(tensor: _Tensor) -> Block:
    return tuple((0, n) for n in tensor.entry.shape)


def _local_block(tensor: _Tensor, block: Block) -> np.ndarray:
    """The block ``block`` of a global array, from this process's shards."""
    shape = tensor.entry.shape
    for shard in tensor.value.addressable_shards:
        if slice_key(shard.index, shape) == block:
            return _stored(shard.data)
    raise CheckpointError(f"Leaf {tensor.path!r}: this process holds no shard {list(block)} (its sharding changed?).")


def _stored(value: Any) -> np.ndarray:
    """The array whose bytes a tensor's data are: little-endian (`little_endian`), in C order
    (np.asarray with order="C", not np.ascontiguousarray: that makes 0-d arrays shape [1])."""
    return np.asarray(little_endian(value), order="C")


# -- several processes ---------------------------------------------------------------------


def _publish_together(
    path: Any,
    tree: "PyTree",
    max_shard_size: int | str | None,
    names: Callable[[str], str] | Mapping[str, str] | None,
    metadata: dict[str, str] | None,
    overwrite: bool,
    progress: Progress,
) -> None:
    """`save_safetensors` in every process of a job: check the arguments and the tree,
    agree on the plan (the call included: every process must ask for the same model),
    uncommit what is there (process 0, holding the directory until the end), write the
    files a round at a time, then the index (process 0)."""
    import jax

    phases = Phases("publish")
    me, count = phases.rank, phases.size
    found: list[tuple[_Publishing, list[_Tensor]]] = []

    def checked() -> None:  # in the first phase: a process's refusal fails every process
        found.append((_Publishing.at(path, max_shard_size, metadata, overwrite), _tensors(tree, names)))

    flat = [leaf for _, _, leaf in flatten(tree)[0] if leaf is not None]
    spanning = global_leaves(flat, phases, before=checked)
    publishing, tensors = found[0]

    def planned() -> str:  # in a phase: a process that cannot plan fails every process
        for i in sorted(spanning):
            if i >= len(tensors) or not isinstance(tensors[i].value, jax.Array):
                where = f"leaf {tensors[i].path!r}" if i < len(tensors) else f"leaf number {i}"
                raise CheckpointError(
                    f"save_safetensors in {count} processes: {where} is a global array in another process but not "
                    "in this one. Every process must pass the same tree of global arrays. Nothing was written."
                )
            tensors[i].holders = block_holders(tensors[i].value.sharding, tensors[i].entry.shape)
        publishing.plan(tensors, count)
        return json.dumps([publishing.fingerprint(), publishing.summary()])

    prints = phases.run("agree", planned)
    differ = [(rank, json.loads(p)[1]) for rank, p in enumerate(prints) if json.loads(p)[0] != json.loads(prints[0])[0]]
    if differ:
        rank, summary = differ[0]
        raise CheckpointError(
            f"save_safetensors in {count} processes: process {rank} asks for {summary}; process 0 for "
            f"{json.loads(prints[0])[1]}. Every process must pass the same path, options and tree of global "
            "arrays, with the same names. Nothing was written."
        )
    with contextlib.ExitStack() as held:

        def prepare() -> str | None:
            if me != 0:
                return None
            held.enter_context(publishing.held())
            if not overwrite and publishing.taken():
                raise publishing.exists_error()
            return publishing.prepare()

        publishing.seen = json.loads(phases.run("prepare", prepare)[0])
        rounds = max(len(publishing.mine(p)) for p in range(count))
        from ..._local._peers import Transfers

        transfers = Transfers()  # its server starts when first offered from or fetched with
        mine = publishing.mine(me)
        stamps: dict[str, str] = {}
        with reporting(
            f"writing {publishing.where}",
            sum(t.entry.nbytes for i in mine for t in publishing.files[i][1]),
            sum(len(publishing.files[i][1]) for i in mine),
            progress,
        ):
            for r in range(rounds):
                stamps.update(_round(publishing, phases, transfers, r))
        phases.run("commit", lambda: publishing.commit(stamps) if me == 0 else None)


def _round(publishing: _Publishing, phases: Phases, transfers: "Transfers", round_: int) -> dict[str, str]:
    """Round ``round_``: each process writes its ``round_``-th file (if it has one), sent
    what it lacks, a wave at a time, by the processes holding it, which offer those
    blocks first (their own device arrays: no copies). Each step is a phase: a process's
    failure fails every process at once.

    **Returns:** the stamps of the files written this round, by every process."""
    me, count = phases.rank, phases.size
    writers = {p: publishing.mine(p)[round_] for p in range(count) if round_ < len(publishing.mine(p))}
    numbers: list[int] = []

    def offer() -> str:
        for writer, shard in writers.items():
            for k, wave in enumerate(publishing.waves(shard)):
                if sent := _from(wave, writer).get(me):
                    numbers.append(_transfer_number(phases.name, round_, me, writer, k))
                    transfers.offer([numbers[-1]], [_sent(t, b) for t, b in sent])
        return transfers.address if numbers else ""

    def write() -> str:
        if me not in writers:
            return "{}"
        shard = writers[me]
        waves = publishing.waves(shard)

        def pull(source: int, blocks: list[tuple[_Tensor, Block | None]], k: int) -> Received:
            specs = [
                ((t.entry.nbytes,), np.dtype(np.uint8)) if b is None else (tuple(y - x for x, y in b), _dtype(t))
                for t, b in blocks
            ]
            number = _transfer_number(phases.name, round_, source, me, k)
            return {
                (tensor.path, block): data.view(_dtype(tensor)).reshape(tensor.entry.shape) if block is None else data
                for (tensor, block), data in zip(blocks, transfers.fetch_arrays(addresses[source], number, specs))
            }

        with concurrent.futures.ThreadPoolExecutor(max(1, count - 1)) as pulls:

            def fetch(k: int) -> Received:  # from every sender at once: each pull is one connection
                received: Received = {}
                senders = sorted(_from(waves[k], me).items())
                for part in pulls.map(lambda item: pull(item[0], item[1], k), senders):
                    received.update(part)
                return received

            return json.dumps(publishing.write(shard, fetch))

    try:
        addresses = phases.run(f"offered/{round_}", offer)
        return {
            name: stamp
            for written in phases.run(f"written/{round_}", write)
            for name, stamp in json.loads(written).items()
        }
    finally:  # what this process sent is held until every writer has it
        for number in numbers:
            transfers.release(number)


def _from(wave: list[_Tensor], writer: int) -> dict[int, list[tuple[_Tensor, Block | None]]]:
    """What ``writer`` lacks of ``wave``'s tensors, by the process that sends it."""
    out: dict[int, list[tuple[_Tensor, Block | None]]] = {}
    for tensor in wave:
        for block, source in tensor.needed(writer):
            out.setdefault(source, []).append((tensor, block))
    return out


def _transfer_number(name: str, round_: int, source: int, writer: int, wave: int) -> int:
    from ..._local._peers import transfer_id

    return transfer_id(name, "publish", round_, source, writer, wave)


def _sent(tensor: _Tensor, block: Block | None) -> Any:
    """What this process sends of ``tensor``: all of it (a host value, as bytes: no device
    narrows them), or its block ``block``, the shard's own device array (no copy)."""
    if block is None:
        return np.ascontiguousarray(_stored(tensor.value)).reshape(-1).view(np.uint8)
    shape = tensor.entry.shape
    for shard in tensor.value.addressable_shards:
        if slice_key(shard.index, shape) == block:
            return shard.data
    raise CheckpointError(f"Leaf {tensor.path!r}: this process holds no shard {list(block)} (its sharding changed?).")
