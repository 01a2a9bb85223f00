"""The manifest, ``eqxckpt.json``: what a checkpoint holds, written last (`_document`);
its leaves as a table of columns (`_table`); their key records (`_keys`)."""

from ._document import (
    CHECKSUM_DIGITS as CHECKSUM_DIGITS,
    CHECKSUM_HEAD as CHECKSUM_HEAD,
    FORMAT as FORMAT,
    MAX_MANIFEST_BYTES as MAX_MANIFEST_BYTES,
    MAX_METADATA_DEPTH as MAX_METADATA_DEPTH,
    MAX_PARSE_FACTOR as MAX_PARSE_FACTOR,
    VERSION as VERSION,
    VERSIONS as VERSIONS,
    Manifest as Manifest,
    check_checksum as check_checksum,
    metadata_bytes as metadata_bytes,
    parse_cost as parse_cost,
    parse_json_object as parse_json_object,
    parse_manifest as parse_manifest,
    with_checksum as with_checksum,
)
from ._keys import KEY_KINDS as KEY_KINDS, parse_keys as parse_keys
from ._table import (
    LeafTable as LeafTable,
    encode_table as encode_table,
    leaf_cell as leaf_cell,
    parse_table as parse_table,
    table_of as table_of,
    table_rows as table_rows,
)
