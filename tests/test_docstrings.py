"""Every example in a public docstring runs, as written, against a scaffold of the
checkpoints, models and files it names; where a line is an expression followed by a
comment that evaluates (``# (2, 3)``, ``# 'float32[4,3]'``), the value must equal it."""

import ast
import asyncio
import contextlib
import inspect
import io
import json
import os
import pathlib
import re
import shutil
import time
import zipfile

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy

import eqxckpt
import eqxckpt.t5
from eqxckpt.t5 import T5, T5Config, relative_position_bucket

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def examples() -> dict[str, str]:
    """``{qualified name: code}`` for the examples of every public docstring (the modules',
    each exported name's and its public methods' and properties')."""
    found: dict[str, str] = {}
    seen: set[int] = set()

    def add(name: str, obj: object) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for i, code in enumerate(re.findall(r"```python\n(.*?)```", inspect.getdoc(obj) or "", flags=re.S)):
            found[name + (f"[{i}]" if i else "")] = code
        if inspect.isclass(obj):
            for attr, value in vars(obj).items():
                value = getattr(value, "__func__", value)
                if not attr.startswith("_") and (inspect.isfunction(value) or isinstance(value, property)):
                    add(f"{name}.{attr}", value)

    for module, names in (
        (eqxckpt, [n for n in dir(eqxckpt) if not n.startswith("_") and n != "t5"]),
        (eqxckpt.t5, eqxckpt.t5.__all__),
    ):
        add(module.__name__, module)
        for attr in names:
            add(f"{module.__name__}.{attr}", getattr(module, attr))
    return found


EXAMPLES = examples()
NEEDS_TF = {"eqxckpt.t5", "eqxckpt.t5.load_tf", "eqxckpt.t5.convert_tf"}
# Names an example uses beyond the common ones, set up just before it.
SETUP = {
    "eqxckpt": "model_skeleton = eqx.filter_eval_shape(lambda: model)\nshutil.rmtree('checkpoints')  # it writes them",
    "eqxckpt.CheckpointManager.metadata": "manager = eqxckpt.CheckpointManager('another_run')",
    "eqxckpt.CheckpointTranslator.apply": """
eqxckpt.save("foreign_ckpt", {"dense_0": {"kernel": np.ones((2, 8), np.float32)}})
translator = eqxckpt.CheckpointTranslator()
translator.add(r"dense_(\\d+)/kernel")(lambda opts, key, value, index: (f"model/layers/{index}/weight", value))
skeleton = {"layers": [{"weight": jax.ShapeDtypeStruct((2, 8), jnp.float32)}]}
""",
    **dict.fromkeys(
        ["eqxckpt.SaveHandle", "eqxckpt.SaveHandle.wait"],
        "shutil.rmtree('ckpt')  # the example writes it",
    ),
    "eqxckpt.save_safetensors": "os.remove('model.safetensors')  # the example writes it",
    "eqxckpt.Checkpoint.process_state": "import grain\n"
    "iterator = iter(grain.MapDataset.range(10).to_iter_dataset())\n"
    "eqxckpt.save('checkpoints/step_100', make_state(), process_state=iterator, overwrite=True)",
    "eqxckpt.CheckpointManager.best_step": "skeleton = eqx.filter_eval_shape(make_model, jax.random.key(0))",
    "eqxckpt.PathError": "tree = {'W': np.ones(2), 'w': np.zeros(2)}  # the same name on a case-insensitive disk",
    "eqxckpt.StructureMismatchError": "like = {**like, 'model': {**like['model'], 'c': np.zeros(2)}}",
    "eqxckpt.UnsupportedLeafError": "shutil.rmtree('ckpt')  # the example writes it\n"
    "tree = {'w': jnp.ones(2), 'activation': jax.nn.relu, 'note': object()}",
    **dict.fromkeys(
        ["eqxckpt.t5.T5.encode", "eqxckpt.t5.T5.decode", "eqxckpt.t5.T5.decode_hidden", "eqxckpt.t5.T5.logits"],
        "input_ids, decoder_input_ids, mask = input_ids[0], decoder_input_ids[0], mask[0]\n"
        "memory = model.encode(input_ids, attention_mask=mask)",
    ),
    "eqxckpt.t5.T5.decode_step": """
cross = jax.vmap(model.cross_cache)(memory)
cache = jax.tree.map(lambda x: jnp.broadcast_to(x, (rows, *x.shape)), model.init_cache(17))
""",
}
# What an example whose point is an error must print (so that the error really came).
PRINTS = {
    "eqxckpt.PathError": "would both be stored at",
    "eqxckpt.StructureMismatchError": "['model/c']",
    "eqxckpt.UnsupportedFormatError": "pickle",
}


@pytest.fixture(scope="module")
def scaffold(tmp_path_factory):
    """The files the examples name, made once: ``ckpt`` (a small checkpoint),
    ``checkpoints/step_100`` (an MLP and its adam state), ``run`` (a manager's steps),
    ``model.safetensors``, the tiny T5 in both formats, and a PyTorch pickle."""
    root = tmp_path_factory.mktemp("scaffold")
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    eqxckpt.save(
        root / "ckpt",
        {"model": {"w": w, "b": np.ones(3, np.float32)}, "opt_state": {"mu": np.zeros(3, np.float32)}},
        metadata={"step": 100},
    )
    state = make_state()
    eqxckpt.save(root / "checkpoints/step_100", state, metadata={"step": 100})
    with eqxckpt.CheckpointManager(root / "run", max_to_keep=3) as manager:
        for step in (100, 200, 300, 400):
            manager.save(step, {**state, "step": step}, metrics={"loss": 0.25 if step == 300 else 0.5})
    safetensors.numpy.save_file({"encoder.proj.weight": w}, str(root / "model.safetensors"))
    with zipfile.ZipFile(root / "pytorch_model.bin", "w") as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
    shutil.copytree(FIXTURES / "t5_v1_1_tiny", root / "t5_v1_1_tiny")
    shutil.copy(FIXTURES / "mtf_tiny_t5.operative_config.gin", root / "t5_v1_1_tiny/operative_config.gin")
    shutil.copy(FIXTURES / "t5_v1_1_tiny/hf/config.json", root / "config.json")
    shutil.copy(FIXTURES / "mtf_tiny_t5.operative_config.gin", root / "operative_config.gin")
    return root


def make_model(key):
    return eqx.nn.MLP(2, 2, 8, 2, key=key)


def make_state():
    model = make_model(jax.random.key(0))
    return {"model": model, "opt_state": optax.adam(1e-3).init(eqx.filter(model, eqx.is_array)), "step": 0}


@pytest.fixture(scope="module")
def tiny_t5():
    return eqxckpt.t5.load_hf(FIXTURES / "t5_v1_1_tiny/hf")


def namespace(name: str, root: pathlib.Path, t5_model) -> dict:
    """The names examples use: modules, then the objects a reader has at that point."""
    rng = np.random.default_rng(0)
    ns: dict = dict(
        eqxckpt=eqxckpt, eqx=eqx, jax=jax, jnp=jnp, np=np, json=json, time=time, safetensors=safetensors,
        T5=T5, T5Config=T5Config, relative_position_bucket=relative_position_bucket, dtype=np.dtype, shutil=shutil, os=os,
    )  # fmt: skip
    ns["ckpt"] = eqxckpt.open(root / "ckpt")
    ns["lazy"] = ns["ckpt"]["model/w"]
    ns["tree"] = ns["state"] = {"w": jnp.ones(3), "step": 0}
    ns["like"] = ns["like_f32"] = eqxckpt.load(root / "ckpt")
    ns["path"], ns["skeleton"] = "ckpt", {"model": make_model(jax.random.key(0))}
    ns["make_model"], ns["init_state"], ns["gather_state"] = make_model, lambda: ns["tree"], lambda: ns["tree"]
    ns["make_state"] = make_state
    ns["train_step"], ns["loss"], ns["step"], ns["start"], ns["num_steps"] = (lambda s: s), 0.25, 500, 500, 503
    ns["log"] = ns["free_space_and_retry"] = print
    ns["translator"], ns["q"] = eqxckpt.CheckpointTranslator(), np.ones(2)
    if name.startswith("eqxckpt.CheckpointManager") or name.endswith("Error"):
        ns["manager"] = eqxckpt.CheckpointManager(root / "run", best_metric="loss")
        ns["tree"] = ns["state"] = make_state()
        ns["skeleton"], ns["previous_step"] = eqx.filter_eval_shape(make_state), 300
    if name.startswith("eqxckpt.SaveHandle"):
        ns["handle"] = eqxckpt.save("async", ns["tree"], blocking=False)
    ns["model"] = make_model(jax.random.key(1))
    ns.setdefault("opt_state", optax.adam(1e-3).init(eqx.filter(ns["model"], eqx.is_array)))
    if name.startswith("eqxckpt.t5"):
        ns["model"], ns["rows"] = t5_model, 2
        ns["input_ids"] = jnp.asarray(rng.integers(2, 500, (2, 7)))
        ns["decoder_input_ids"] = jnp.asarray(rng.integers(2, 500, (2, 5)))
        ns["attention_mask"] = ns["mask"] = jnp.ones((2, 7), jnp.int32).at[1, 5:].set(0)
        ns["memory"] = jax.vmap(t5_model.encode)(ns["input_ids"], attention_mask=ns["mask"])
        ns["config"] = t5_model.config
    exec(SETUP.get(name, ""), ns)  # noqa: S102 - the test's own set-up
    return ns


def same(value, expected) -> bool:
    """``value`` is what the comment says (a trailing ``...`` in a list: a prefix)."""
    if isinstance(expected, list) and expected and expected[-1] is Ellipsis:
        return isinstance(value, (list, tuple)) and same(list(value[: len(expected) - 1]), expected[:-1])
    if isinstance(value, (dict, list, tuple)) or isinstance(expected, (dict, list, tuple)):
        leaves = jax.tree.leaves(value), jax.tree.leaves(expected)
        return jax.tree.structure(value) == jax.tree.structure(expected) and all(
            np.array_equal(a, b) for a, b in zip(*leaves)
        )
    return bool(np.all(value == expected))


def run(code: str, ns: dict, where: str) -> int:
    """Run ``code`` line group by line group; returns how many commented values were checked."""
    checked = 0
    tree = ast.parse(code)
    lines = code.splitlines()
    for node in tree.body:
        piece = ast.Module(body=[node], type_ignores=[])
        flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        compiled = compile(piece, where, "exec", flags=flags)
        comment = None
        if isinstance(node, ast.Expr) and node.end_lineno == node.lineno:
            text = lines[node.lineno - 1]
            if "#" in text[node.end_col_offset :]:
                comment = text[node.end_col_offset :].split("#", 1)[1].strip()
        if comment is not None:
            try:
                expected = eval(comment, dict(ns))  # noqa: S307 - our own docstrings
            except Exception:
                comment = None  # prose, not a value
        if comment is not None and not isinstance(node.value, ast.Await):
            value = eval(compile(ast.Expression(node.value), where, "eval"), ns)  # noqa: S307
            assert same(value, expected), f"{where}: {lines[node.lineno - 1].strip()!r} gives {value!r}"
            checked += 1
            continue
        result = eval(compiled, ns)  # noqa: S307 - our own docstrings
        if inspect.iscoroutine(result):
            asyncio.run(result)
    return checked


def test_every_public_docstring_has_its_examples_collected():
    assert len(EXAMPLES) >= 80
    for name in ("eqxckpt.load", "eqxckpt.CheckpointManager.metadata", "eqxckpt.t5.save_hf", "eqxckpt.Source.origin"):
        assert name in EXAMPLES
    assert set(SETUP) <= set(EXAMPLES) and set(PRINTS) <= set(EXAMPLES) and NEEDS_TF <= set(EXAMPLES)


def marks(name: str) -> list:
    """TensorFlow for the Mesh TensorFlow examples; slow for those that run the T5 (compiling)."""
    runs_t5 = name.startswith("eqxckpt.t5") and not name.startswith("eqxckpt.t5.T5Config")
    return [pytest.mark.tf] * (name in NEEDS_TF) + [pytest.mark.slow] * runs_t5


@pytest.mark.parametrize("name", [pytest.param(name, marks=marks(name)) for name in sorted(EXAMPLES)])
def test_docstring_example_runs(name, scaffold, tiny_t5, tmp_path, monkeypatch):
    work = tmp_path / "work"
    # The T5 files are only read: hard links spare a copy per example (readers refuse symlinks).
    link = lambda src, dst: os.link(src, dst) if "/t5_v1_1_tiny/" in src else shutil.copy2(src, dst)  # noqa: E731
    shutil.copytree(scaffold, work, copy_function=link)
    monkeypatch.chdir(work)
    ns = namespace(name, work, tiny_t5)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run(EXAMPLES[name], ns, f"<{name} docstring>")
    if name in PRINTS:
        assert PRINTS[name] in out.getvalue(), out.getvalue()
    for value in ns.values():
        if isinstance(value, eqxckpt.CheckpointManager):
            value.__exit__(None, None, None)


def test_a_commented_value_that_differs_fails_and_prose_is_left_alone():
    ns = {"x": np.ones((4, 3))}
    assert run("x[:2].shape  # (2, 3)\nx.sum()  # 12.0\nx  # the whole array\nx.shape  # [4, ...]", ns, "ok") == 3
    with pytest.raises(AssertionError, match=r"gives \(2, 3\)"):
        run("x[:2].shape  # (2, 4)", ns, "wrong")
