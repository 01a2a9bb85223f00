import numpy as np
import pytest

import eqxckpt


def make_translator():
    t = eqxckpt.CheckpointTranslator()

    @t.add(r"encoder/block_(\d+)/(q|k|v)")
    def _attn(opts, key, value, block, name):
        return f"encoder/layers/{int(block)}/attn/{name}", value * opts.get("scale", 1)

    @t.add(r".*_slot_v")
    def _drop_slots(opts, key, value):
        return None, None

    @t.add(r"encoder/.*")  # never reached for q/k/v: the first matching rule wins
    def _rest(opts, key, value):
        return key.replace("encoder/", "enc/"), value

    return t


def test_rules_rename_drop_and_pass_opts():
    flat = {"encoder/block_000/q": 1, "encoder/block_001/v": 2, "encoder/block_001/v_slot_v": 3, "encoder/final": 4}
    assert make_translator().apply(flat, scale=10) == {
        "encoder/layers/0/attn/q": 10,
        "encoder/layers/1/attn/v": 20,
        "enc/final": 4,
    }


def test_unmatched_keys_are_listed_all_at_once():
    with pytest.raises(eqxckpt.TransformError, match=r"2 keys match no translation rule:\n  decoder/x\n  global_step"):
        make_translator().apply({"decoder/x": 1, "encoder/block_000/q": 1, "global_step": 5})


def test_patterns_must_match_whole_keys():
    t = eqxckpt.CheckpointTranslator()
    t.add(r"a")(lambda opts, k, v: (k, v))
    with pytest.raises(eqxckpt.TransformError, match="ab"):
        t.apply({"ab": 1})
    assert t.apply({"a": 1}) == {"a": 1}


def test_lazy_values_stay_lazy(tmp_path):
    eqxckpt.save(tmp_path / "c", {"w": np.arange(4.0)})
    lazy = eqxckpt.open(tmp_path / "c")["w"]
    t = eqxckpt.CheckpointTranslator()
    t.add(r"w")(lambda opts, k, v: ("weight", v))
    out = t.apply({"w": lazy})
    assert out["weight"] is lazy


def test_errors():
    with pytest.raises(eqxckpt.TransformError, match="not a valid regex"):
        eqxckpt.CheckpointTranslator().add("(")
    t = eqxckpt.CheckpointTranslator()
    t.add(r"(a|b)")(lambda opts, k, v, letter: ("same", v))
    with pytest.raises(eqxckpt.TransformError, match="both translate to 'same'"):
        t.apply({"a": 1, "b": 2})
    t = eqxckpt.CheckpointTranslator()
    t.add(r"x")(lambda opts, k, v: 1 / 0)
    with pytest.raises(ZeroDivisionError) as info:
        t.apply({"x": 1})
    assert "while translating 'x'" in "".join(info.value.__notes__)
