"""`Stack` and `Unstack`: restores that change a model's layout, from every source.

A per-layer model (a list of blocks) and a scanned one (the blocks stacked with
`eqx.filter_vmap`) are restored from each other's checkpoints written by eqxckpt,
`safetensors`, `orbax-checkpoint` and TensorFlow, bit for bit; the errors name the
leaves involved; an unstacking restore reads each stored byte once.
"""

import collections
import json
import os
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_equal, counting_storage, save_tf_tensors
from hypothesis import HealthCheck, given, settings, strategies as st

import eqxckpt
import eqxckpt._chunks as chunks_module
from eqxckpt._read._checkpoint import open_checkpoint

LAYERS = 4
STACK = {r"blocks/(.*)": eqxckpt.Stack(r"blocks/{i}/\1")}
UNSTACK = {r"blocks/(\d+)/(.*)": eqxckpt.Unstack(r"blocks/\2", index=r"\1")}


class Block(eqx.Module):
    up: eqx.nn.Linear
    scale: jax.Array

    def __init__(self, key):
        self.up = eqx.nn.Linear(6, 5, key=key)
        self.scale = jax.random.uniform(jax.random.fold_in(key, 1), (5,))


class PerLayer(eqx.Module):
    embed: jax.Array
    blocks: list[Block]

    def __init__(self, layers=LAYERS, seed=0):
        keys = jax.random.split(jax.random.key(seed), layers + 1)
        self.embed = jax.random.normal(keys[0], (7, 6))
        self.blocks = [Block(k) for k in keys[1:]]


class Scanned(eqx.Module):
    embed: jax.Array
    blocks: Block  # every array with a leading layer axis

    def __init__(self, layers=LAYERS, seed=0):
        keys = jax.random.split(jax.random.key(seed), layers + 1)
        self.embed = jax.random.normal(keys[0], (7, 6))
        self.blocks = eqx.filter_vmap(Block)(keys[1:])


def stacked(model: PerLayer) -> Scanned:
    """The same weights in the scanned layout, stacked in memory (the reference)."""
    scanned = eqx.filter_eval_shape(Scanned, len(model.blocks))
    blocks = jax.tree.map(lambda *layers: jnp.stack(layers), *model.blocks)
    return eqx.tree_at(lambda m: (m.embed, m.blocks), scanned, (model.embed, blocks))


def unstacked(model: Scanned, layers: int = LAYERS) -> PerLayer:
    per_layer = eqx.filter_eval_shape(PerLayer, layers)
    blocks = [jax.tree.map(lambda x, i=i: x[i], model.blocks) for i in range(layers)]
    return eqx.tree_at(lambda m: (m.embed, m.blocks), per_layer, (model.embed, blocks))


def assert_same_arrays(a, b):
    """Same structure; every array leaf the same dtype, shape and bits."""
    as_numpy = lambda tree: jax.tree.map(np.asarray, eqx.filter(tree, eqx.is_array))  # noqa: E731
    assert_trees_equal(as_numpy(a), as_numpy(b))


def flat_arrays(tmp_path, model) -> dict[str, np.ndarray]:
    """``{path: array}`` of a model, as eqxckpt names its leaves."""
    eqxckpt.save(tmp_path / "flat", model, overwrite=True)
    ckpt = eqxckpt.open(tmp_path / "flat")
    return {path: ckpt[path].get() for path in ckpt.paths}


def write(kind: str, tmp_path, model, name: str):
    """``model`` written as ``kind`` writes it, by that format's own writer: where to load it from."""
    where = tmp_path / name
    if kind == "eqxckpt":
        eqxckpt.save(where, model)
        return where
    flat = flat_arrays(tmp_path, model)
    if kind == "safetensors":
        from safetensors.numpy import save_file

        save_file({path.replace("/", "."): value for path, value in flat.items()}, str(where))  # HF's names
        return where
    if kind == "huggingface directory":  # sharded, with HuggingFace's index
        from safetensors.numpy import save_file

        where.mkdir()
        names = sorted(path.replace("/", ".") for path in flat)
        shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for shard, members in shards.items():
            save_file({name: flat[name.replace(".", "/")] for name in members}, str(where / shard))
        index = {"metadata": {}, "weight_map": {name: shard for shard, members in shards.items() for name in members}}
        (where / "model.safetensors.index.json").write_text(json.dumps(index))
        return where
    if kind == "orbax":
        import orbax.checkpoint as ocp

        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(os.fspath(where), eqxckpt.load(tmp_path / "flat"))  # plain dicts and lists
        checkpointer.wait_until_finished()
        return where
    assert kind == "tensorflow"
    save_tf_tensors(where, flat)
    return where


SOURCES = ["eqxckpt", "safetensors", "huggingface directory", "orbax", pytest.param("tensorflow", marks=pytest.mark.tf)]


@pytest.mark.parametrize("kind", SOURCES)
def test_per_layer_weights_restore_into_a_scanned_model_and_back(kind, tmp_path):
    model = PerLayer()
    scanned = eqxckpt.load(write(kind, tmp_path, model, "per_layer"), Scanned, transforms=STACK)
    assert_same_arrays(scanned, stacked(model))
    assert scanned.blocks.up.weight.shape == (LAYERS, 5, 6)
    # And back, from the scanned model's own checkpoint in the same format.
    back = eqxckpt.load(write(kind, tmp_path, scanned, "scanned"), PerLayer, transforms=UNSTACK)
    assert_same_arrays(back, model)


def test_composes_with_at_cast_other_transforms_and_a_translator(tmp_path):
    model = PerLayer()
    eqxckpt.save(tmp_path / "c", {"model": model, "step": 3})
    reference = stacked(model)
    # at= and cast=: bfloat16 skeleton, each layer cast as it is read (values checked to fit).
    skeleton = jax.tree.map(lambda x: x.update(dtype=jnp.bfloat16), eqx.filter_eval_shape(Scanned))
    cast = eqxckpt.load(tmp_path / "c", skeleton, at="model", transforms=STACK, cast=True)
    assert cast.blocks.up.weight.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(cast.blocks.up.weight), np.asarray(reference.blocks.up.weight, jnp.bfloat16)
    )
    with pytest.raises(eqxckpt.StructureMismatchError, match="pass cast=True"):
        eqxckpt.load(tmp_path / "c", skeleton, at="model", transforms=STACK)
    # Beside a Transform with a value_fn.
    rules = {r"blocks/(.*)": eqxckpt.Stack(r"blocks/{i}/\1"), "embed": eqxckpt.Transform(value_fn=lambda e: e * 2)}
    doubled = eqxckpt.load(tmp_path / "c", Scanned, at="model", transforms=rules)
    np.testing.assert_array_equal(np.asarray(doubled.embed), np.asarray(model.embed) * 2)
    assert_same_arrays(doubled.blocks, reference.blocks)
    # From a CheckpointTranslator view whose names are HuggingFace-like.
    translator = eqxckpt.CheckpointTranslator()

    @translator.add(r"model/blocks/(\d+)/(.*)")
    def _(opts, key, value, layer, rest):
        return f"layers.{layer}.{rest.replace('/', '.')}", value

    @translator.add(r"model/embed|step")
    def _(opts, key, value):
        return key.replace("model/", ""), value

    view = translator.apply(eqxckpt.open(tmp_path / "c"))
    rules = {r"blocks/up/(.*)": eqxckpt.Stack(r"layers.{i}.up.\1"), r"blocks/scale": eqxckpt.Stack("layers.{i}.scale")}
    assert_same_arrays(eqxckpt.load(view, Scanned, transforms=rules), reference)


@pytest.fixture
def layered(tmp_path):
    """Checkpoints of a 4-layer model: per-layer, scanned, with a layer's leaf missing or
    misshapen, and with 6 layers."""
    model = PerLayer()
    eqxckpt.save(tmp_path / "per_layer", model)
    eqxckpt.save(tmp_path / "scanned", stacked(model))
    eqxckpt.save(tmp_path / "six", PerLayer(6))
    tree = eqxckpt.load(tmp_path / "per_layer")
    tree["blocks"][2]["scale"] = np.zeros(4, np.float32)
    tree["blocks"][1]["up"]["bias"] = np.zeros(5, np.float64)
    eqxckpt.save(tmp_path / "odd", tree)
    del tree["blocks"][3]
    eqxckpt.save(tmp_path / "three", tree)
    return tmp_path, model


def mismatch(path, like, transforms, **options) -> dict[str, str]:
    with pytest.raises(eqxckpt.StructureMismatchError) as info:
        eqxckpt.load(path, like, transforms=transforms, **options)
    return dict(info.value.mismatched)


def test_errors_name_the_leaves_involved(layered):
    root, model = layered
    found = mismatch(root / "three", Scanned, STACK)  # a missing layer
    assert set(found) == {"blocks/up/weight", "blocks/up/bias", "blocks/scale"}
    assert (
        "stacks 4 layers for float32[4,5,6], but the checkpoint has no 'blocks/3/up/weight'"
        in found["blocks/up/weight"]
    )
    found = mismatch(root / "odd", Scanned, STACK)  # layers that differ
    assert set(found) == {"blocks/up/bias", "blocks/scale"}
    assert "float64[5] at 'blocks/1/up/bias'" in found["blocks/up/bias"]
    assert "float32[4] at 'blocks/2/scale'" in found["blocks/scale"]
    assert "float32[5] at 'blocks/0/scale', 'blocks/1/scale', 'blocks/3/scale'" in found["blocks/scale"]
    found = mismatch(root / "six", Scanned, STACK)  # more layers stored than `like` stacks
    assert (
        "`like` stacks 4 layers (float32[4,5]), but the checkpoint has 6 ('blocks/0/scale' to 'blocks/5/scale')"
        in found["blocks/scale"]
    )
    found = mismatch(root / "scanned", lambda: PerLayer(3), UNSTACK)  # fewer rows taken than stored
    assert (
        "stacks 4 rows in 'blocks/scale' (float32[4,5]), but `like` takes 3 of them (not rows 3)"
        in found["blocks/0/scale"]
    )
    found = mismatch(root / "scanned", lambda: PerLayer(5), UNSTACK)  # a row out of range
    assert set(found) == {"blocks/4/up/weight", "blocks/4/up/bias", "blocks/4/scale"}
    assert (
        "index=4): index out of range for 'blocks/up/weight' (float32[4,5,6], rows 0 to 3)"
        in found["blocks/4/up/weight"]
    )
    found = mismatch(root / "per_layer", Scanned, {"blocks/(.*)": eqxckpt.Unstack(r"blocks/0/\1", 0)})  # a misfit row
    assert "expected float32[4,5,6], found float32[6] (row 0 of 'blocks/0/up/weight'" in found["blocks/up/weight"]
    # Not strict: the first layers, or the rows `like` has.
    six = eqxckpt.load(root / "six", Scanned, transforms=STACK, strict=False)
    assert_same_arrays(six.blocks, jax.tree.map(lambda x: x[:4], stacked(PerLayer(6)).blocks))
    three = eqxckpt.load(root / "scanned", lambda: PerLayer(3), transforms=UNSTACK, strict=False)
    assert_same_arrays(three.blocks, model.blocks[:3])


@pytest.mark.parametrize(
    "rule, why",
    [
        (lambda: eqxckpt.Stack("blocks/0/w"), "must contain '{i}'"),
        (lambda: eqxckpt.Unstack("blocks/w", index=1.5), "index must be an int or a backreference"),
        (lambda: eqxckpt.Unstack("blocks/w", index=True), "index must be an int or a backreference"),
        (lambda: eqxckpt.Unstack("blocks/w", index="\u0661").row(re.match("", ""), "w"), "not a row number"),
        (lambda: eqxckpt.Unstack("blocks/w", index=" 1").row(re.match("", ""), "w"), "not a row number"),
    ],
)
def test_malformed_rules_are_transform_errors(rule, why):
    with pytest.raises(eqxckpt.TransformError, match=why):
        rule()


def test_an_index_group_that_is_not_a_number_is_a_transform_error(layered):
    root, _ = layered
    with pytest.raises(eqxckpt.TransformError, match="gives 'up' for 'blocks/0/up/weight', which is not a row"):
        eqxckpt.load(
            root / "scanned", PerLayer, transforms={r"blocks/(\d+)/(\w+)/.*": eqxckpt.Unstack(r"blocks/\2", r"\2")}
        )


def test_in_memory_trees_change_layout_too():
    model = PerLayer()
    scanned = eqxckpt.apply_transformations(model, STACK, eqx.filter_eval_shape(Scanned))
    assert_same_arrays(scanned, stacked(model))
    back = eqxckpt.apply_transformations(scanned, UNSTACK, eqx.filter_eval_shape(PerLayer))
    assert_same_arrays(back, model)
    with pytest.raises(eqxckpt.TransformError, match="the original tree has no"):
        eqxckpt.apply_transformations(model, STACK, eqx.filter_eval_shape(Scanned, 5))
    with pytest.raises(eqxckpt.TransformError, match="index out of range"):
        eqxckpt.apply_transformations(scanned, UNSTACK, eqx.filter_eval_shape(PerLayer, 5))


def test_unstacking_reads_each_chunk_of_a_stacked_leaf_once(tmp_path, monkeypatch):
    """A stacked leaf of 12 rows in chunks of 3 rows, unstacked with a budget of 5 rows:
    windows of 3 rows (a chunk's), every chunk read once in all; with a budget over the
    whole leaf, one window. Not once per row."""
    monkeypatch.setattr(chunks_module, "CHUNK_BYTES", 3 * 64 * 64 * 4)
    rng = np.random.default_rng(0)
    stacked_w = rng.standard_normal((12, 64, 64)).astype(np.float32)
    eqxckpt.save(tmp_path / "s", {"blocks": {"w": stacked_w}})
    storage, reads = counting_storage(tmp_path / "s")
    like = {"blocks": [{"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)} for _ in range(12)]}
    for budget in (5 * 64 * 64 * 4, 1 << 30):
        reads.clear()
        out = eqxckpt.load(open_checkpoint(storage), like, transforms=UNSTACK, host_memory_budget=budget)
        for i in range(12):
            np.testing.assert_array_equal(np.asarray(out["blocks"][i]["w"]), stacked_w[i])
        assert reads == {f"blocks/w/c/{c}/0/0": 1 for c in range(4)}, reads
    # Two rows of twelve (not strict) read only the chunks holding them.
    reads.clear()
    two = {"blocks": {"1": like["blocks"][0], "10": like["blocks"][0]}}
    out = eqxckpt.load(open_checkpoint(storage), two, transforms=UNSTACK, strict=False)
    np.testing.assert_array_equal(np.asarray(out["blocks"]["10"]["w"]), stacked_w[10])
    assert reads == {"blocks/w/c/0/0/0": 1, "blocks/w/c/3/0/0": 1}, reads


def test_unstacking_a_safetensors_file_reads_each_byte_once(tmp_path, monkeypatch):
    from safetensors.numpy import save_file

    import eqxckpt._formats._safetensors._read as safetensors_module

    rng = np.random.default_rng(1)
    tensors = {
        "blocks.w": rng.standard_normal((8, 32, 16)).astype(np.float32),
        "blocks.b": np.arange(8, dtype=np.int64),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    read_bytes = collections.Counter()
    real = safetensors_module.read_range

    def counted(fd, offset, buffer, path):
        read_bytes[path] += buffer.nbytes
        real(fd, offset, buffer, path)

    monkeypatch.setattr(safetensors_module, "read_range", counted)
    like = {"blocks": [{"w": np.zeros((32, 16), np.float32), "b": np.zeros((), np.int64)} for _ in range(8)]}
    out = eqxckpt.load(tmp_path / "model.safetensors", like, transforms=UNSTACK, host_memory_budget=3 * 32 * 16 * 4)
    for i in range(8):
        np.testing.assert_array_equal(out["blocks"][i]["w"], tensors["blocks.w"][i])
        assert out["blocks"][i]["b"] == i and isinstance(out["blocks"][i]["b"], np.ndarray)
    assert read_bytes == {"blocks/w": 8 * 32 * 16 * 4, "blocks/b": 8 * 8}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layers=st.integers(1, 6),
    layer_shape=st.lists(st.integers(0, 5), max_size=3).map(tuple),
    dtype=st.sampled_from(["float32", "float16", "int8", "bool", "uint16"]),
    kind=st.sampled_from(["eqxckpt", "safetensors"]),
    chunk_bytes=st.sampled_from([16, 64, 1 << 20]),
    budget=st.sampled_from([1, 100, 1 << 20]),
    into_numpy=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_stack_then_unstack_gives_back_every_layer_bit_for_bit(
    tmp_path_factory, monkeypatch, layers, layer_shape, dtype, kind, chunk_bytes, budget, into_numpy, seed
):
    """Any number of layers of any shape (0-d and empty included) and dtype, any chunking
    and host budget: the stacked restore is the layers stacked, and the rows of its own
    checkpoint are the layers again, into numpy or jax leaves."""
    from safetensors.numpy import save_file

    monkeypatch.setattr(chunks_module, "CHUNK_BYTES", chunk_bytes)
    root = tmp_path_factory.mktemp("layers")
    rng = np.random.default_rng(seed)
    per_layer = [
        np.asarray(rng.integers(0, 2**16, layer_shape) % (2 if dtype == "bool" else 100), dtype) for _ in range(layers)
    ]
    stacked_value = np.stack(per_layer)

    def like(shape):
        return np.zeros(shape, dtype) if into_numpy else jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))

    def written(name, tree, flat):
        if kind == "eqxckpt":
            eqxckpt.save(root / name, tree)
            return root / name
        save_file(flat, str(root / f"{name}.safetensors"))
        return root / f"{name}.safetensors"

    source = written(
        "per_layer", {"blocks": [{"w": x} for x in per_layer]}, {f"blocks.{i}.w": x for i, x in enumerate(per_layer)}
    )
    out = eqxckpt.load(
        source, {"blocks": {"w": like(stacked_value.shape)}}, transforms=STACK, host_memory_budget=budget
    )
    got = np.asarray(out["blocks"]["w"])
    assert got.dtype == stacked_value.dtype and got.shape == stacked_value.shape
    assert got.tobytes() == stacked_value.tobytes()
    source = written("stacked", {"blocks": {"w": stacked_value}}, {"blocks.w": stacked_value})
    rows = eqxckpt.load(
        source,
        {"blocks": [{"w": like(layer_shape)} for _ in range(layers)]},
        transforms=UNSTACK,
        host_memory_budget=budget,
    )
    for i, x in enumerate(per_layer):
        row = rows["blocks"][i]["w"]
        # Into numpy leaves: numpy; into a skeleton: what was saved (numpy), or jax for foreign tensors.
        assert isinstance(row, np.ndarray if into_numpy or kind == "eqxckpt" else jax.Array)
        assert row.shape == x.shape and np.asarray(row).tobytes() == x.tobytes()


# -- Found by an outside attack on the change (each failed before its fix) ------------------


def test_two_leaves_taking_one_row_share_no_memory(tmp_path):
    """A numpy and a jax leaf (or two numpy leaves) taking the same row: each result has
    its own buffer, so writing one changes neither the other nor the immutable jax array."""
    eqxckpt.save(tmp_path / "s", {"w": np.arange(4 * 64, dtype=np.float32).reshape(4, 64)})
    like = {"a": np.zeros(64, np.float32), "b": jnp.zeros(64, jnp.float32), "c": np.zeros(64, np.float32)}
    rules = {name: eqxckpt.Unstack("w", 1) for name in like}
    out = eqxckpt.load(tmp_path / "s", like, transforms=rules, strict=False)
    out["a"][:] = -5.0
    np.testing.assert_array_equal(np.asarray(out["b"]), np.arange(64, 128, dtype=np.float32))
    np.testing.assert_array_equal(out["c"], np.arange(64, 128, dtype=np.float32))


def test_rows_taken_from_a_larger_window_hold_only_themselves(tmp_path):
    eqxckpt.save(tmp_path / "s", {"w": np.zeros((64, 4096), np.float32)})  # one chunk: read whole
    like = {"a": np.zeros(4096, np.float32), "b": np.zeros(4096, np.float32)}
    rows = {"a": eqxckpt.Unstack("w", 0), "b": eqxckpt.Unstack("w", 63)}
    out = eqxckpt.load(tmp_path / "s", like, transforms=rows, strict=False)
    for row in out.values():
        held = row
        while held.base is not None:
            held = held.base
        assert held.nbytes < 2 * row.nbytes, f"a {row.nbytes}-byte row holds a {held.nbytes}-byte buffer"


def test_small_packed_layers_are_read_in_one_batch(tmp_path):
    """48 layers of two small leaves, packed into one chunk: Stack reads that chunk once,
    as a plain restore does (it read it once per layer per leaf: 96 times); Unstack of
    small stacked leaves likewise."""
    layers = [{"b": np.full(16, i, np.float32), "g": np.full(16, -i, np.float32)} for i in range(48)]
    eqxckpt.save(tmp_path / "pk", {"blocks": layers})
    storage, reads = counting_storage(tmp_path / "pk")
    like = {"blocks": {"b": np.zeros((48, 16), np.float32), "g": np.zeros((48, 16), np.float32)}}
    progress = []
    out = eqxckpt.load(open_checkpoint(storage), like, transforms=STACK, progress=lambda *a: progress.append(a))
    np.testing.assert_array_equal(out["blocks"]["g"][:, 3], -np.arange(48))
    assert reads == {"%packed/c/0": 1}, reads
    assert progress[-1] == (2 * 48 * 16 * 4, 2 * 48 * 16 * 4, 2, 2)  # counted once, as the stacked leaves
    eqxckpt.save(tmp_path / "st", {"blocks": {f"w{j}": np.full((4, 8), j, np.int16) for j in range(40)}})
    storage, reads = counting_storage(tmp_path / "st")
    like = {"blocks": [{f"w{j}": np.zeros(8, np.int16) for j in range(40)} for _ in range(4)]}
    out = eqxckpt.load(open_checkpoint(storage), like, transforms=UNSTACK)
    assert out["blocks"][3]["w39"].tolist() == [39] * 8 and reads == {"%packed/c/0": 1}, reads


@pytest.mark.parametrize("rules", ["stack", "unstack"])
def test_a_layout_restore_larger_than_the_memory_left_is_refused_first(tmp_path, monkeypatch, rules):
    import eqxckpt._window as window

    layers = [np.full((256, 256), i, np.float32) for i in range(4)]
    eqxckpt.save(tmp_path / "per_layer", {"blocks": [{"w": x} for x in layers]})
    eqxckpt.save(tmp_path / "stacked", {"blocks": {"w": np.stack(layers)}})
    monkeypatch.setattr(window, "available_memory", lambda: 64 * 1024)
    with pytest.raises(eqxckpt.CheckpointError, match="host memory"):
        if rules == "stack":
            eqxckpt.load(
                tmp_path / "per_layer", {"blocks": {"w": np.zeros((4, 256, 256), np.float32)}}, transforms=STACK
            )
        else:
            like = {"blocks": [{"w": np.zeros((256, 256), np.float32)} for _ in range(4)]}
            eqxckpt.load(tmp_path / "stacked", like, transforms=UNSTACK)


@pytest.mark.parametrize("kind", ["eqxckpt", "safetensors"])
@pytest.mark.parametrize(
    "region, out, why",
    [
        ((slice(2, 6), slice(0, 3)), np.zeros((4, 3), np.float32), "not a range of a dimension of length 4"),
        ((slice(-2, 4), slice(0, 3)), np.zeros((2, 3), np.float32), "not a range"),
        ((slice(0, 4, 2), slice(0, 3)), np.zeros((2, 3), np.float32), "step 1"),
        ((slice(0, 2), slice(0, 3)), np.zeros((2, 3), np.float64), "out must be a numpy array of float32\\[2, 3\\]"),
        ((slice(0, 2), slice(0, 3)), np.zeros((3, 2), np.float32), "got float32\\[3, 2\\]"),
        ((slice(0, 2),), np.zeros((2, 3), np.float32), "a tuple of 2 slices"),
        ((slice(0, 4), slice(0, 3)), np.zeros((3, 4), np.float32).T, "C-contiguous"),
    ],
)
def test_read_into_refuses_a_region_or_buffer_that_does_not_fit(tmp_path, kind, region, out, why):
    """Never other bytes as values (the next tensor's, a file header's), never a caller's
    slip reported as a damaged checkpoint."""
    from safetensors.numpy import save_file

    tensors = {"a": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.full((4, 3), -1, np.float32)}
    if kind == "eqxckpt":
        eqxckpt.save(tmp_path / "c", tensors)
        source = eqxckpt.open(tmp_path / "c")
    else:
        save_file(tensors, str(tmp_path / "c.safetensors"))
        source = eqxckpt.open(tmp_path / "c.safetensors")
    with pytest.raises(eqxckpt.ArgumentError, match=why):
        source.read_into(source.leaf("a"), region, out)
    whole = np.empty((4, 3), np.float32)
    source.read_into(source.leaf("a"), (slice(None), slice(0, 3)), whole)  # None: the whole dimension
    np.testing.assert_array_equal(whole, tensors["a"])


def test_in_memory_stacks_of_numbers_keys_and_skeletons():
    stack = lambda original, new: eqxckpt.apply_transformations(original, STACK, new)["blocks"]["w"]  # noqa: E731
    assert stack({"blocks": [{"w": 1.0}, {"w": 2.0}]}, {"blocks": {"w": np.zeros(2)}}).tolist() == [1.0, 2.0]
    keys = [jax.random.key(i) for i in range(2)]
    stacked_keys = stack({"blocks": [{"w": k} for k in keys]}, {"blocks": {"w": jax.random.split(jax.random.key(0))}})
    assert jnp.array_equal(jax.random.key_data(stacked_keys), jnp.stack([jax.random.key_data(k) for k in keys]))
    layer = jax.ShapeDtypeStruct((2,), jnp.float32)
    assert stack({"blocks": [{"w": layer}] * 3}, {"blocks": {"w": np.zeros((3, 2))}}) == jax.ShapeDtypeStruct(
        (3, 2), jnp.float32
    )
    with pytest.raises(eqxckpt.TransformError, match="at least one layer"):
        stack({"blocks": [{"w": np.ones(2)}]}, {"blocks": {"w": np.zeros((0, 2))}})
    with pytest.raises(eqxckpt.TransformError, match="not arrays or numbers"):
        stack({"blocks": [{"w": "a"}, {"w": "b"}]}, {"blocks": {"w": np.zeros(2)}})


def test_a_stacked_leaf_restored_whole_and_a_row_of_it_is_strict(tmp_path):
    """Tied weights: `like` takes the stacked leaf whole and one row of it; every stored
    leaf is restored, so strict=True does not refuse it."""
    stacked_w = np.arange(12, dtype=np.float32).reshape(4, 3)
    eqxckpt.save(tmp_path / "s", {"blocks": {"w": stacked_w}})
    like = {"blocks": {"w": np.zeros((4, 3), np.float32)}, "first": np.zeros(3, np.float32)}
    out = eqxckpt.load(tmp_path / "s", like, transforms={"first": eqxckpt.Unstack("blocks/w", 0)})
    np.testing.assert_array_equal(out["first"], stacked_w[0])
    np.testing.assert_array_equal(out["blocks"]["w"], stacked_w)


def test_layout_restores_check_the_digest_of_each_leaf_they_read_whole(tmp_path):
    """Chunks swapped between two leaves pass their checksums; a `Stack` that reads each
    layer whole, and an `Unstack` that reads every row of a stacked leaf, check the
    digests as a plain load does (they returned the layers in the wrong order)."""
    zeros, ones = np.zeros((300, 300), np.float32), np.ones((300, 300), np.float32)
    eqxckpt.save(
        tmp_path / "c",
        {"layers": [{"w": zeros}, {"w": ones}], "stacked": np.stack([zeros, ones]), "o": np.stack([ones, zeros])},
    )
    stack_like = {"w": jax.ShapeDtypeStruct((2, 300, 300), jnp.float32)}
    stack = {"w": eqxckpt.Stack("layers/{i}/w")}
    unstack_like = {"rows": [zeros, zeros]}
    unstack = {r"rows/(\d+)": eqxckpt.Unstack("stacked", index=r"\1")}
    for one, other, like, transforms in [
        ("layers/0/w/c/0/0", "layers/1/w/c/0/0", stack_like, stack),
        ("stacked/c/0/0/0", "o/c/0/0/0", unstack_like, unstack),
    ]:
        a, b = tmp_path / "c" / one, tmp_path / "c" / other
        a_bytes, b_bytes = a.read_bytes(), b.read_bytes()
        a.write_bytes(b_bytes)
        b.write_bytes(a_bytes)
        with pytest.raises(eqxckpt.CorruptCheckpointError, match="not the bytes saved"):
            eqxckpt.load(tmp_path / "c", like, transforms=transforms, strict=False)
        a.write_bytes(a_bytes)
        b.write_bytes(b_bytes)
    out = eqxckpt.load(tmp_path / "c", stack_like, transforms=stack, strict=False)
    np.testing.assert_array_equal(np.asarray(out["w"]), np.stack([zeros, ones]))
    out = eqxckpt.load(tmp_path / "c", unstack_like, transforms=unstack, strict=False)
    np.testing.assert_array_equal(out["rows"][1], ones)
