"""TensorStore as eqxckpt uses it: the one process-wide context (object stores' kvstores,
Orbax arrays), and reading the errors TensorStore raises."""

import os
import re

import tensorstore as ts

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


_STATUS = re.compile(r"^[A-Z][A-Z_]+: ")


def is_storage_error(error: BaseException) -> bool:
    """Whether ``error`` is TensorStore reporting a failed storage operation
    (a ``ValueError`` whose message starts with a status such as ``NOT_FOUND:``)."""
    return isinstance(error, ValueError) and bool(_STATUS.match(str(error)))


def reason(error: BaseException | str) -> str:
    """A TensorStore error's message without the spec dump that follows it."""
    return str(error).split(" [tensorstore_spec=")[0].split(" [http_response_body=")[0]
