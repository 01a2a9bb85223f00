"""Writing: `save` (`_save`) plans, snapshots and digests a tree, then writes, checks and
commits it; what each process writes is a piece (`_pieces`), small leaves are packed in
one array (`_pack`), incremental saves take unchanged leaves from a base (`_reuse`),
replicated data is divided among its holders (`_shares`), and background saves run one
at a time (`_background`). Imported by module path; this face holds nothing."""
