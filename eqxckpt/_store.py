"""How a checkpoint's arrays are laid out: chunk shapes, stored dtypes, and TensorStore's
context and read specs (every chunk of eqxckpt's own arrays is read through `_chunks`).

The one place that picks chunk shapes, knows which dtypes are stored natively, and
turns a host value into the little-endian array whose bytes every writer stores.
"""

import contextlib
import contextvars
import itertools
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from ._errors import CheckpointError
from ._paths import PACKED_LOCATION

# Chunks are bounded so a partial or resharded read touches little more than
# it needs, and big enough that per-file overhead stays small.
CHUNK_BYTES = 64 * 1024 * 1024
# The packed array of small leaves (see `_pack`) has small chunks: reading one leaf
# lazily, or only the model's, reads little more than those bytes.
PACK_CHUNK_BYTES = 4 * 1024 * 1024

# dtypes that zarr3 in TensorStore stores natively (uint4 is not among them).
STORED_DTYPES = frozenset(
    "bool int2 int4 int8 int16 int32 int64 uint8 uint16 uint32 uint64 "
    "float16 bfloat16 float32 float64 complex64 complex128 float8_e4m3fn "
    "float8_e4m3fnuz float8_e4m3b11fnuz float8_e5m2 float8_e5m2fnuz".split()
)


_CONTEXT: ts.Context | None = None
S3_RETRIES = int(os.environ.get("EQXCKPT_S3_RETRIES", "6"))
GCS_RETRIES = int(os.environ.get("EQXCKPT_GCS_RETRIES", "6"))


def shared_context() -> ts.Context:
    """The process-wide TensorStore context: shared I/O pools, no chunk cache.

    One context for everything, because a ``memory://`` store lives in its
    context, and shared pools bound total concurrency across saves and loads.
    TensorStore does not fsync each file (``file_io_sync``): a save makes its
    files durable at once with `sync_filesystem`. Whole chunks are read and
    written by `_chunks` (local files with ``preadv``/``writev``), lazy
    selections too; TensorStore maps foreign arrays (Orbax), and checkpoint files are
    never modified in place (saves write new directories), so a mapping never
    sees a file shrink.
    """
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = ts.Context(
            {
                "file_io_sync": False,
                "file_io_mode": {"mode": "memmap"},
                "cache_pool": {"total_bytes_limit": 0},
                # An unreachable endpoint fails within about 20 s, not after many minutes of retries.
                "s3_request_retries": {"max_retries": S3_RETRIES, "initial_delay": "0.5s", "max_delay": "4s"},
                "gcs_request_retries": {"max_retries": GCS_RETRIES, "initial_delay": "0.5s", "max_delay": "4s"},
            }
        )
    return _CONTEXT


# The host memory a restore may hold beyond its result (`load`'s host_memory_budget).
DEFAULT_HOST_MEMORY_BUDGET = 256 << 20
_HOST_MEMORY_BUDGET: contextvars.ContextVar[int] = contextvars.ContextVar(
    "eqxckpt_host_memory_budget", default=DEFAULT_HOST_MEMORY_BUDGET
)


@contextlib.contextmanager
def limited_host_memory(nbytes: int | None) -> Iterator[None]:
    """Reads inside hold at most ``nbytes`` in flight (None: the default)."""
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1):
        raise CheckpointError(f"host_memory_budget must be a positive number of bytes, got {nbytes!r}.")
    token = _HOST_MEMORY_BUDGET.set(DEFAULT_HOST_MEMORY_BUDGET if nbytes is None else nbytes)
    try:
        yield
    finally:
        _HOST_MEMORY_BUDGET.reset(token)


def host_memory_budget() -> int:
    """The host memory a restore may hold beyond its result, here (`limited_host_memory`)."""
    return _HOST_MEMORY_BUDGET.get()


def read_window(total_bytes: int) -> int:
    """Bytes of reads in flight at once, so that a restore (or a copy) peaks near
    the bytes it moves: a local read maps its chunk files while it copies them,
    an object-store read holds the fetched chunks. A quarter of the total,
    between 16 MiB and the host memory budget (256 MiB by default): on 792 MiB
    in 200 leaves, 0.38-0.43 s at a peak of 1.06x; 16 MiB windows are ~30%
    slower. A budget below 16 MiB is kept to."""
    budget = _HOST_MEMORY_BUDGET.get()
    return min(budget, max(16 << 20, total_bytes // 4))


def chunk_shape(
    shape: tuple[int, ...], itemsize: int, shard: tuple[int, ...] | None = None, budget: int | None = None
) -> list[int]:
    """A C-contiguous chunk shape of at most ``budget`` bytes that tiles ``shard``.

    Trailing dimensions are kept whole while they fit, so each chunk is one
    contiguous run of the array and a full read is a few large sequential reads.
    Along a sharded dimension the chunk divides the shard exactly, so no chunk
    straddles two writers' shards (two writers on one chunk would lose data).

    ```python
    chunk_shape((1024, 1024), 4, budget=1 << 20)                    # [256, 1024]
    chunk_shape((1024, 1024), 4, shard=(512, 1024), budget=3 << 20)  # [512, 1024]
    ```
    """
    shard = tuple(shape) if shard is None else tuple(shard)
    elements = max(1, (CHUNK_BYTES if budget is None else budget) // max(1, itemsize))
    chunk: list[int] = []
    for dim, part in zip(reversed(shape), reversed(shard)):
        part = max(1, part)
        if part <= elements:
            chunk.append(part)
            elements //= part
        else:
            size = max(1, elements)
            chunk.append(_largest_divisor(part, size) if part < dim else size)
            elements = 1
    return chunk[::-1]


def chunk_regions(chunk: Sequence[int], region: Sequence[slice]) -> list[tuple[slice, ...]]:
    """The part of ``region`` in each chunk it covers, in C order. ``region`` (slices with
    explicit bounds) starts on chunk boundaries: a whole array, a shard, a run of chunks.

    ```python
    chunk_regions([2, 4], [slice(0, 3), slice(0, 4)])  # rows 0-1, then row 2
    ```
    """
    if any(s.start >= s.stop for s in region):
        return []  # empty: `product` would first list every start along the other dimensions
    starts = itertools.product(*(range(s.start, s.stop, c) for s, c in zip(region, chunk)))
    return [tuple(slice(a, min(a + c, s.stop)) for a, c, s in zip(first, chunk, region)) for first in starts]


def _largest_divisor(n: int, at_most: int) -> int:
    best = 1
    for d in range(1, int(n**0.5) + 1):
        if n % d == 0:
            for candidate in (d, n // d):
                if best < candidate <= at_most:
                    best = candidate
    return best


def chunk_budget(path: str) -> int:
    """The most bytes a chunk of the array at ``path`` holds."""
    return PACK_CHUNK_BYTES if path == PACKED_LOCATION else CHUNK_BYTES


_STATUS = re.compile(r"^[A-Z][A-Z_]+: ")


def is_storage_error(error: BaseException) -> bool:
    """Whether ``error`` is TensorStore reporting a failed storage operation
    (a ``ValueError`` whose message starts with a status such as ``NOT_FOUND:``)."""
    return isinstance(error, ValueError) and bool(_STATUS.match(str(error)))


def reason(error: BaseException | str) -> str:
    """A TensorStore error's message without the spec dump that follows it."""
    return str(error).split(" [tensorstore_spec=")[0].split(" [http_response_body=")[0]


def little_endian(value: Any, copy: bool = False) -> np.ndarray:
    """``value`` as a host array in the byte order every format eqxckpt writes holds
    (little-endian: the zarr3 ``bytes`` codec as eqxckpt configures it, the packed array,
    safetensors) and its digests cover. Every writer takes the values it stores from here,
    so their bytes, their digest and what a load returns agree: the array itself where its
    bytes are that already, else a byte-swapped copy (a big-endian numpy array).

    ``copy``: a fresh array in any case (one pass, swapping as it copies).
    """
    array = np.asarray(value)
    little = array.dtype.newbyteorder("<")  # equal to the dtype itself unless it is big-endian
    if copy or array.dtype != little:
        return np.array(array, dtype=little, copy=True)
    return array


def check_dtype(dtype: np.dtype, where: str) -> None:
    if dtype.name not in STORED_DTYPES:
        hint = " Cast it to uint8 first." if dtype.name == "uint4" else ""
        raise CheckpointError(
            f"Leaf {where!r} has dtype {dtype.name}, which TensorStore's zarr3 cannot store natively.{hint}"
        )
