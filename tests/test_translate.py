import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from conftest import manifest_doc

import eqxckpt
from eqxckpt._stored import StoredArrays


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


def test_a_translated_checkpoint_loads_like_a_checkpoint_reading_only_what_it_needs(tmp_path, monkeypatch):
    """apply() on an opened checkpoint gives a source: load() restores from it with
    the same strictness and at=, reading only the leaves the result needs."""
    rng = np.random.default_rng(0)
    foreign = {
        "dense_0": {"kernel": rng.standard_normal((3, 4), np.float32), "bias": np.zeros(4, np.float32)},
        "dense_1": {"kernel": rng.standard_normal((4, 2), np.float32), "bias": np.ones(2, np.float32)},
        "opt": {"mu": rng.standard_normal((1000,), np.float32)},
    }
    eqxckpt.save(tmp_path / "foreign", foreign)
    t = eqxckpt.CheckpointTranslator()

    @t.add(r"dense_(\d)/kernel")
    def _w(opts, key, value, index):
        return f"model/layers/{index}/weight", value

    @t.add(r"dense_(\d)/bias")
    def _b(opts, key, value, index):
        return f"model/layers/{index}/bias", value.get() * 2  # computed when translated, held in memory

    @t.add(r"opt/(.*)")
    def _opt(opts, key, value, name):
        return f"opt_state/{name}", value

    view = t.apply(eqxckpt.open(tmp_path / "foreign"))
    assert sorted(view.paths) == sorted(
        ["model/layers/0/weight", "model/layers/0/bias", "model/layers/1/weight", "model/layers/1/bias", "opt_state/mu"]
    )
    assert view.leaf("model/layers/1/weight").describe() == "float32[4,2]"
    read = []
    real = StoredArrays.open_metadata
    monkeypatch.setattr(StoredArrays, "open_metadata", lambda self, leaf: (read.append(leaf.path), real(self, leaf))[1])
    like = {
        "layers": [
            {"weight": np.zeros((3, 4), np.float32), "bias": np.zeros(4, np.float32)},
            {"weight": np.zeros((4, 2), np.float32), "bias": np.zeros(2, np.float32)},
        ]
    }
    model = eqxckpt.load(view, like, at="model")
    np.testing.assert_array_equal(model["layers"][0]["weight"], foreign["dense_0"]["kernel"])
    np.testing.assert_array_equal(model["layers"][1]["weight"], foreign["dense_1"]["kernel"])
    np.testing.assert_array_equal(model["layers"][1]["bias"], 2 * foreign["dense_1"]["bias"])
    assert "opt/mu" not in read and sorted(set(read)) == ["dense_0/kernel", "dense_1/kernel"]
    # Strict as a checkpoint is: a shape that does not fit is named with its translated path.
    like["layers"][1]["weight"] = np.zeros((2, 4), np.float32)
    with pytest.raises(eqxckpt.StructureMismatchError, match="layers/1/weight: expected float32\\[2,4\\]") as e:
        eqxckpt.load(view, like, at="model")
    assert [path for path, _ in e.value.mismatched] == ["layers/1/weight"]
    # And Transform rules work on it too.
    renamed = {"first": np.zeros((3, 4), np.float32)}
    got = eqxckpt.load(
        view, renamed, at="model", transforms={"first": eqxckpt.Transform(original_key="layers/0/weight")}
    )
    np.testing.assert_array_equal(got["first"], foreign["dense_0"]["kernel"])


def test_rules_that_make_a_leaf_and_a_subtree_of_one_name_are_refused(tmp_path):
    eqxckpt.save(tmp_path / "c", {"x": np.ones(2), "y": np.zeros(2)})
    translator = eqxckpt.CheckpointTranslator()
    translator.add("x")(lambda opts, key, value: ("a", value))
    translator.add("y")(lambda opts, key, value: ("a/b", value))
    with pytest.raises(eqxckpt.ManifestError, match="'a' is a tensor and also holds 'a/b'"):
        translator.apply(eqxckpt.open(tmp_path / "c"))


def test_a_rule_can_transpose_a_stored_matrix_lazily_and_misfits_name_the_stored_tensor(tmp_path, monkeypatch):
    """A rule returning `Transposed` (how HuggingFace's ``[out, in]`` matrices are read):
    the view's leaf has the turned shape, is read only when restored, turned as it is
    read and cast like any leaf; errors name the tensor as the file does."""
    from eqxckpt._read._translate import Transposed

    rng = np.random.default_rng(0)
    tensors = {"proj.weight": rng.standard_normal((3, 5)).astype(np.float32), "proj.bias": np.ones(3, np.float32)}
    safetensors.numpy.save_file(tensors, str(tmp_path / "m.safetensors"))
    source = eqxckpt.open(tmp_path / "m.safetensors")
    assert source.origin("proj/weight") == "proj.weight"
    t = eqxckpt.CheckpointTranslator()
    t.add(r"proj/weight")(lambda opts, key, value: ("dense/kernel", Transposed(value)))
    t.add(r"proj/bias")(lambda opts, key, value: ("dense/bias", value))
    view = t.apply(source)
    assert view.leaf("dense/kernel").describe() == "float32[5,3]"
    assert view.origin("dense/kernel") == "proj.weight (transposed)" and view.origin("dense/bias") == "proj.bias"
    read = []
    real = type(source)._fetch  # the format's reads of whole leaves: a restore's and a lazy get()'s
    monkeypatch.setattr(
        type(source), "_fetch", lambda self, leaves, *args: (read.append(len(leaves)), real(self, leaves, *args))[1]
    )
    like = {"kernel": jax.ShapeDtypeStruct((5, 3), jnp.bfloat16), "bias": jnp.zeros(3, jnp.float32)}
    out = eqxckpt.load(view, like, at="dense", cast=True)
    assert read == [2]
    assert out["kernel"].dtype == jnp.bfloat16 and isinstance(out["kernel"], jax.Array)
    np.testing.assert_array_equal(np.asarray(out["kernel"]), tensors["proj.weight"].T.astype(jnp.bfloat16))
    np.testing.assert_array_equal(view["dense/kernel"].get(), tensors["proj.weight"].T)
    with pytest.raises(eqxckpt.StructureMismatchError) as e:
        eqxckpt.load(view, {"kernel": np.zeros((3, 5), np.float32), "bias": np.zeros(3, np.float32)}, at="dense")
    assert e.value.mismatched == [
        ("kernel", "expected float32[3,5], found float32[5,3], stored as proj.weight (transposed)")
    ]
    assert read == [2, 1]  # the load and the get() above; nothing for the refused load
    other = eqxckpt.CheckpointTranslator()
    other.add(r".*")(lambda opts, key, value: (key, Transposed(np.ones(2))))
    with pytest.raises(eqxckpt.TransformError, match="not an array of the source"):
        other.apply(source)


class BertLayer(eqx.Module):
    attn: eqx.nn.MultiheadAttention
    norm: eqx.nn.LayerNorm
    dropout: eqx.nn.Dropout

    def __init__(self, d: int, key):
        bias = dict(use_query_bias=True, use_key_bias=True, use_value_bias=True, use_output_bias=True)
        self.attn = eqx.nn.MultiheadAttention(2, d, dropout_p=0.1, **bias, key=key)
        self.norm = eqx.nn.LayerNorm(d)
        self.dropout = eqx.nn.Dropout(0.2)


class Bert(eqx.Module):
    embed: eqx.nn.Embedding
    layers: list[BertLayer]

    def __init__(self, key, vocab: int = 11, d: int = 8, depth: int = 2):
        k0, *ks = jax.random.split(key, depth + 1)
        self.embed = eqx.nn.Embedding(vocab, d, key=k0)
        self.layers = [BertLayer(d, k) for k in ks]


def bert_file(path, vocab: int = 11, d: int = 8, depth: int = 2) -> dict[str, np.ndarray]:
    """A file as HuggingFace's BertForMaskedLM writes it: dotted names, [out, in] weights."""
    rng = np.random.default_rng(0)
    tensors = {"bert.embeddings.word_embeddings.weight": rng.standard_normal((vocab, d), np.float32)}
    for i in range(depth):
        at = f"bert.encoder.layer.{i}.attention"
        for name in ("self.query", "self.key", "self.value", "output.dense"):
            tensors[f"{at}.{name}.weight"] = rng.standard_normal((d, d), np.float32)
            tensors[f"{at}.{name}.bias"] = rng.standard_normal(d).astype(np.float32)
        tensors[f"{at}.output.LayerNorm.weight"] = rng.standard_normal(d).astype(np.float32)
        tensors[f"{at}.output.LayerNorm.bias"] = rng.standard_normal(d).astype(np.float32)
    tensors["cls.predictions.bias"] = np.zeros(vocab, np.float32)  # the head: not in this model
    safetensors.numpy.save_file(tensors, str(path))
    return tensors


BERT_NAMES = {  # ours -> the file's (after `open`, whose paths use '/')
    r"embed/weight": r"bert/embeddings/word_embeddings/weight",
    r"layers/(\d+)/attn/(query|key|value)_proj/(weight|bias)": r"bert/encoder/layer/\1/attention/self/\2/\3",
    r"layers/(\d+)/attn/output_proj/(weight|bias)": r"bert/encoder/layer/\1/attention/output/dense/\2",
    r"layers/(\d+)/norm/(weight|bias)": r"bert/encoder/layer/\1/attention/output/LayerNorm/\2",
}


def test_a_bert_like_huggingface_file_loads_strict_by_either_route(tmp_path):
    """A module's Python fields (Dropout's `p` and `inference`, in MultiheadAttention too),
    which no safetensors file can hold, come from the skeleton on both routes."""
    tensors = bert_file(tmp_path / "model.safetensors")
    source = eqxckpt.open(tmp_path / "model.safetensors")
    skeleton = eqx.nn.inference_mode(Bert(jax.random.key(1)))  # `inference=True`: visibly the skeleton's

    translator = eqxckpt.CheckpointTranslator()

    @translator.add(r"bert/embeddings/word_embeddings/weight")
    def _embed(opts, key, value):
        return "embed/weight", value

    @translator.add(r"bert/encoder/layer/(\d+)/attention/self/(query|key|value)/(weight|bias)")
    def _qkv(opts, key, value, layer, name, what):
        return f"layers/{layer}/attn/{name}_proj/{what}", value

    @translator.add(r"bert/encoder/layer/(\d+)/attention/output/dense/(weight|bias)")
    def _out(opts, key, value, layer, what):
        return f"layers/{layer}/attn/output_proj/{what}", value

    @translator.add(r"bert/encoder/layer/(\d+)/attention/output/LayerNorm/(weight|bias)")
    def _norm(opts, key, value, layer, what):
        return f"layers/{layer}/norm/{what}", value

    @translator.add(r"cls/.*")
    def _head(opts, key, value):
        return None, value

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing kept or ignored to warn about
        translated = eqxckpt.load(translator.apply(source), skeleton)
        transformed = eqxckpt.load(
            source,
            skeleton,
            transforms={ours: eqxckpt.Transform(original_key=file) for ours, file in BERT_NAMES.items()},
        )
    for model in (translated, transformed):
        np.testing.assert_array_equal(model.embed.weight, tensors["bert.embeddings.word_embeddings.weight"])
        for i, layer in enumerate(model.layers):
            at = f"bert.encoder.layer.{i}.attention"
            np.testing.assert_array_equal(layer.attn.query_proj.weight, tensors[f"{at}.self.query.weight"])
            np.testing.assert_array_equal(layer.attn.value_proj.bias, tensors[f"{at}.self.value.bias"])
            np.testing.assert_array_equal(layer.attn.output_proj.weight, tensors[f"{at}.output.dense.weight"])
            np.testing.assert_array_equal(layer.norm.bias, tensors[f"{at}.output.LayerNorm.bias"])
            assert (layer.dropout.p, layer.dropout.inference) == (0.2, True)
            assert (layer.attn.dropout.p, layer.attn.dropout.inference) == (0.1, True)
    assert jax.tree_util.tree_structure(translated) == jax.tree_util.tree_structure(transformed)


def test_arrays_missing_from_a_foreign_file_are_still_missing(tmp_path):
    """Only Python fields come from the skeleton: the weights a file lacks are listed, its
    Dropout fields are not."""
    bert_file(tmp_path / "model.safetensors")
    with pytest.raises(eqxckpt.StructureMismatchError) as info:
        eqxckpt.load(eqxckpt.open(tmp_path / "model.safetensors"), Bert(jax.random.key(1)))  # no renaming
    assert "layers/0/norm/weight: expected float32[8]" in str(info.value)
    assert "dropout" not in str(info.value)


# A translated view of 64-bit data saved from JAX, read with x64 off.
BIG_INT64 = (2**40 + np.arange(6)).reshape(2, 3)


def _transposed_int64_view(tmp_path):
    with jax.enable_x64(True):
        eqxckpt.save(tmp_path / "c", {"w": jax.numpy.asarray(BIG_INT64)})
    assert not jax.config.read("jax_enable_x64")
    t = eqxckpt.CheckpointTranslator()
    from eqxckpt._read._translate import Transposed

    t.add(r"w")(lambda opts, key, value: ("t", Transposed(value)))
    return t.apply(eqxckpt.open(tmp_path / "c"))


def test_a_transposed_leaf_loads_into_numpy_without_narrowing(tmp_path):
    # numpy targets hold 64-bit data whatever x64 says: nothing to refuse, nothing to narrow.
    got = eqxckpt.load(_transposed_int64_view(tmp_path), {"t": np.zeros((3, 2), np.int64)})
    np.testing.assert_array_equal(got["t"], BIG_INT64.T)
    view = _transposed_int64_view(tmp_path / "again")
    (value,) = view.read([(view.leaf("t"), np.zeros((3, 2), np.int64))])
    np.testing.assert_array_equal(value, BIG_INT64.T)


def test_a_transposed_leaf_read_into_jax_is_refused_not_narrowed(tmp_path):
    view = _transposed_int64_view(tmp_path)
    with pytest.raises(eqxckpt.CastError, match=r"t: int64 would become int32"):
        view.read([(view.leaf("t"), None)])


def test_a_computed_leaf_read_into_jax_is_refused_not_narrowed(tmp_path):
    eqxckpt.save(tmp_path / "c", {"w": np.zeros(3, np.float32)})
    t = eqxckpt.CheckpointTranslator()
    t.add(r"w")(lambda opts, key, value: ("big", BIG_INT64[0]))
    view = t.apply(eqxckpt.open(tmp_path / "c"))
    sharded = jax.ShapeDtypeStruct((3,), np.int64, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    with pytest.raises(eqxckpt.CastError, match=r"big: int64 would become int32"):
        view.read([(view.leaf("big"), sharded)])


def test_a_transposed_leaf_is_checked_against_the_original_digest(tmp_path, monkeypatch):
    # Chunks swapped between two leaves pass their checksums; only the digest sees them. A
    # transposed view read them unchecked (its own leaf records no digest: its bytes are
    # the original's, turned).
    import eqxckpt._chunks as chunks
    from eqxckpt._read._translate import Transposed

    monkeypatch.setattr(chunks, "CHUNK_BYTES", 4096)
    a = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    eqxckpt.save(tmp_path / "c", {"a": a, "b": -a})
    one, other = tmp_path / "c" / "a" / "c" / "1" / "0", tmp_path / "c" / "b" / "c" / "1" / "0"
    swapped = one.read_bytes()
    one.write_bytes(other.read_bytes())
    other.write_bytes(swapped)
    translator = eqxckpt.CheckpointTranslator()
    translator.add("a")(lambda opts, key, value: ("t", Transposed(value)))
    translator.add("b")(lambda opts, key, value: (None, value))
    view = translator.apply(eqxckpt.open(tmp_path / "c"))
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="digest") as caught:
        eqxckpt.load(view, {"t": np.zeros((64, 64), np.float32)})
    assert caught.value.leaf_path == "a"
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="digest"):
        view["t"][3].get()
    with pytest.raises(eqxckpt.CorruptCheckpointError, match="digest"):
        view.read_into(view.leaf("t"), (slice(0, 1), slice(0, 64)), np.empty((1, 64), np.float32))


def test_transposing_a_leaf_of_a_part_is_refused_when_the_view_is_made(tmp_path, monkeypatch):
    # A part holds some blocks of a leaf; its transpose's blocks were not turned, so a lazy
    # read of the view took rows of the original the part does not hold.

    from _trees import crafted_manifest

    import eqxckpt._chunks as chunks
    from eqxckpt._read._translate import Transposed

    monkeypatch.setattr(chunks, "CHUNK_BYTES", 48)  # chunks of 2 rows: they tile the part's block
    eqxckpt.save(tmp_path / "c", {"w": np.arange(36, dtype=np.float32).reshape(6, 6)})
    doc = manifest_doc((tmp_path / "c" / "eqxckpt.json").read_bytes())
    (leaf,) = [leaf for leaf in doc["leaves"] if leaf["path"] == "w"]
    leaf["blocks"] = [[[2, 4], [0, 6]]]
    del leaf["digest"]
    (tmp_path / "c" / "eqxckpt.json").write_bytes(crafted_manifest(doc))
    translator = eqxckpt.CheckpointTranslator()
    translator.add("w")(lambda opts, key, value: ("t", Transposed(value)))
    with pytest.raises(eqxckpt.TransformError, match="holds only some blocks"):
        translator.apply(eqxckpt.open(tmp_path / "c"))
    renamed = eqxckpt.CheckpointTranslator()
    renamed.add("w")(lambda opts, key, value: ("t", value))
    view = renamed.apply(eqxckpt.open(tmp_path / "c"))
    np.testing.assert_array_equal(view["t"][2:4].get(), np.arange(12, 24, dtype=np.float32).reshape(2, 6))
    with pytest.raises(eqxckpt.ArgumentError, match="holds only"):
        view["t"][1:3].get()
