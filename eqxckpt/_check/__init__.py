"""Checking checkpoints: `verify` (`_verify`), its repair from twins (`_repair`), and
`diff` (`_diff`). Imported by module path; this face holds nothing."""
