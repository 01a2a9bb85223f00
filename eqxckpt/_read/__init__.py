"""Reading: a restore's plan and its one engine. `load` plans a restore from a `Source`
(`_source`: the interface a format implements; `_checkpoint`: eqxckpt's own), with
`Transform` rules (`_transform`), layout rules (`_restack`: `Stack`, `Unstack`) and
translated views (`_translate`); leaves are placed on their devices band by band within
the host memory budget (`_place`, which also owns blocks of a sharding), a lazy
selection reads only its chunks (`_select`), and data replicated across processes is
read once in all (`_read_once`). Imported by module path; this face holds nothing."""
