"""Attack 10: `verify`'s packed-leaf digests (`_check_packed`) with leaves straddling
packed chunks, a bool leaf, an empty leaf and an unusual name; two chunks swapped."""

import json
import os

import numpy as np

import eqxckpt


def test_swapped_packed_chunks_damage_exactly_the_leaves_in_them(tmp_path):
    rng = np.random.default_rng(0)
    tree = {f"l{i:03d}": rng.standard_normal(30000).astype(np.float32) for i in range(80)}  # some straddle
    tree["bools"] = rng.integers(0, 2, 1000).astype(bool)
    tree["empty"] = np.zeros((0, 3), np.float32)
    tree["weird name-é"] = np.ones(7, np.int8)
    where = tmp_path / "ckpt"
    eqxckpt.save(where, tree)
    assert not eqxckpt.verify(where).problems
    a, b = where / "%packed/c/0", where / "%packed/c/1"
    assert a.stat().st_size == b.stat().st_size  # each passes its own CRC after the swap
    os.rename(a, tmp_path / "t")
    os.rename(b, a)
    os.rename(tmp_path / "t", b)
    chunk = a.stat().st_size - 4
    leaves = json.loads((where / "eqxckpt.json").read_text())["leaves"]
    expected = {
        leaf["path"]
        for leaf in leaves
        if leaf.get("offset") is not None and leaf["offset"] < 2 * chunk and np.prod(leaf["shape"]) > 0
    }
    found = {path for path, _ in eqxckpt.verify(where).problems}
    assert found == expected and "bools" in found and "empty" not in found, found ^ expected
    restored = eqxckpt.load(where, at="l079") if "l079" not in found else None
    if restored is not None:
        assert np.asarray(restored).tobytes() == tree["l079"].tobytes()
