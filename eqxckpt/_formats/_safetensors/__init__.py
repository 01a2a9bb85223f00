"""safetensors: reading a file or a sharded HuggingFace directory (`_read`), writing
one from one process or from every process of a job (`_write`), and the layout both
follow byte for byte (`_layout`)."""

from ._layout import (
    DTYPES as DTYPES,
    INDEX_NAME as INDEX_NAME,
    NAMES as NAMES,
    SINGLE_NAME as SINGLE_NAME,
    SUB_BYTE as SUB_BYTE,
    TensorEntry as TensorEntry,
    file_header as file_header,
    parse_size as parse_size,
    split as split,
)
from ._read import (
    SafetensorsCheckpoint as SafetensorsCheckpoint,
    name_to_keys as name_to_keys,
    open_safetensors as open_safetensors,
    read_by_rows as read_by_rows,
    read_header as read_header,
)
from ._write import assign as assign, save_safetensors as save_safetensors
