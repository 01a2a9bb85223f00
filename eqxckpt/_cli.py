"""The ``eqxckpt`` command line: look at checkpoints without the model code.

Each command imports the modules it runs: ``--help`` and ``inspect`` start without JAX.
"""

import argparse
import json
import re
import sys
import typing
from typing import TYPE_CHECKING

from ._errors import CheckpointError
from ._formats._open import FORMATS
from ._version import __version__

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

    from ._check._verify import VerifyReport
    from ._storage import Storage


def human_bytes(n: int) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError


def checkpoint_path(text: str) -> str | dict:
    """A command-line PATH: a path or URL, or a TensorStore kvstore spec as JSON.

    ```
    $ eqxckpt inspect '{"driver": "s3", "bucket": "b", "path": "run/1/", "endpoint": "http://127.0.0.1:9000"}'
    ```
    """
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"PATH looks like a JSON kvstore spec but is not valid JSON: {e}") from None
        if not isinstance(spec, dict):
            raise CheckpointError("A JSON PATH must be a kvstore spec object.")
        return spec
    return text


def console() -> "Console":
    """Where the commands print: on a terminal, rich's layout; piped or redirected, one
    line per line, never wrapped or cut, so grep and logs see whole messages."""
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 1_000_000)


def _inspect(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.tree import Tree

    from ._formats._open import open as open_source
    from ._leaf import listed_blocks
    from ._paths import depth, normalize_at, nothing_under

    checkpoint = open_source(checkpoint_path(args.path), format=args.format)
    prefix = normalize_at(args.at)
    records = checkpoint.records(prefix)
    if not records:
        raise nothing_under(checkpoint, args.at)
    out = console()
    root = Tree(f"[bold]{checkpoint.location}[/bold]" + (f" [dim](at {prefix})[/dim]" if prefix else ""))
    base = depth(prefix)
    nodes: dict[tuple, Tree] = {}  # directory prefix -> its branch; above `at` is the root
    for rel, record in records.items():
        # The keys as the tree has them (a stored path may shorten or escape them).
        parts = tuple(escape(str(key)) for _, key in record.keys)
        for i in range(base + 1, len(parts)):
            if parts[:i] not in nodes:
                nodes[parts[:i]] = nodes.get(parts[: i - 1], root).add(f"[bold blue]{parts[i - 1]}[/bold blue]")
        size = f"  [dim]{human_bytes(record.nbytes)}[/dim]" if record.stored else ""
        if blocks := getattr(record, "blocks", None):  # a part of a checkpoint (a local tier's)
            size += f"  [dim]holds {listed_blocks(blocks)}[/dim]"
        label = parts[-1] if rel and parts else escape("/".join(parts) or record.path or "<root>")
        nodes.get(parts[:-1], root).add(f"{label}  [green]{record.describe()}[/green]{size}")
    out.print(root)
    arrays = [r for r in records.values() if r.stored]
    out.print(
        f"[bold]{len(records)} leaves[/bold], {len(arrays)} arrays, "
        f"{human_bytes(sum(r.nbytes for r in arrays))} of array data"
    )
    if checkpoint.metadata:
        out.print("[bold]metadata[/bold]: " + json.dumps(checkpoint.metadata, sort_keys=True))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from ._check._verify import verify
    from ._errors import CheckpointNotFoundError, plural
    from ._storage import resolve

    out = console()
    path = checkpoint_path(args.path)
    try:
        report = verify(path, progress=True, repair=args.repair)
    except CheckpointNotFoundError:
        steps = resolve(path).committed_entries()
        if not steps:
            raise
        return _verify_run(out, resolve(path), steps, args.repair)
    _print_mended(out, "", report)
    for leaf, message, details in report.lines():
        out.print(f"[bold red]{escape(leaf)}[/bold red]: {escape(message)}")
        for detail in details:
            out.print(f"  {escape(detail)}")
    damaged = f", {plural(len(report.problems), 'problem')}" if report.problems else ""
    summary = (
        f"{escape(report.location)}: {plural(report.leaves, 'leaf', 'leaves')}, "
        f"{plural(report.arrays_checked, 'array')} intact ({human_bytes(report.bytes_checked)} read and checked){damaged}"
    )
    return _verdict(out, report.ok, ("OK", "DAMAGED", "red"), summary)


def _print_mended(out: "Console", prefix: str, report: "VerifyReport") -> None:
    from rich.markup import escape

    for leaf, twin in report.mended:
        out.print(f"[bold green]{escape(prefix + leaf)}[/bold green]: mended from its twin in {escape(twin)}")
    for leaf, why in report.unmended:
        out.print(f"[bold red]{escape(prefix + leaf)}[/bold red]: not mended: {escape(why)}")


def _verify_run(out: "Console", run: "Storage", steps: list[str], repair: bool = False) -> int:
    """``eqxckpt verify`` of a directory of checkpoints (a manager's run): each one verified
    (and mended, with ``repair``), and a problem in files several of them share
    (incremental saves) told once, naming them all, rather than once per checkpoint."""
    from rich.markup import escape

    from ._check._verify import verify
    from ._errors import CheckpointNotFoundError, plural

    told: set[tuple[str, str, tuple[str, ...]]] = set()
    damaged: list[str] = []
    checked, verified = 0, 0
    for step in steps:
        try:
            report = verify(run.sub(step).user_path(), progress=True, repair=repair)
        except CheckpointNotFoundError:
            continue  # deleted since the directory was listed (retention)
        _print_mended(out, f"{step}/", report)
        verified += 1
        checked += report.bytes_checked
        if not report.ok:
            damaged.append(step)
        for leaf, message, details in report.lines():
            holders = tuple([step, *report.shared_with.get(leaf, [])])
            if (leaf, message, tuple(sorted(holders))) in told:
                continue  # the same damaged files, told with a checkpoint that shares them
            told.add((leaf, message, tuple(sorted(holders))))
            out.print(f"[bold red]{escape(step)}/{escape(leaf)}[/bold red]: {escape(message)}")
            for detail in details:
                out.print(f"  {escape(detail)}")
    summary = (
        f"{escape(str(run))}: {plural(verified, 'checkpoint')}, "
        + (f"{len(damaged)} damaged ({', '.join(damaged)}), " if damaged else "all intact, ")
        + f"{human_bytes(checked)} read and checked"
    )
    return _verdict(out, not damaged, ("OK", "DAMAGED", "red"), summary)


def _verdict(out: "Console", ok: bool, words: tuple[str, str, str], summary: str) -> int:
    """A check's last line, ``words`` being (the word when ok, when not, its colour then),
    and its exit status: 0 when ok, else 1."""
    colour = "green" if ok else words[2]
    out.print(f"[bold {colour}]{words[0] if ok else words[1]}[/bold {colour}] {summary}")
    return 0 if ok else 1


def _diff(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from ._check._diff import diff
    from ._formats._open import open as open_source

    out = console()
    result = diff(
        open_source(checkpoint_path(args.a), format=args.format),
        open_source(checkpoint_path(args.b), format=args.format_b or args.format),
        at=args.at,
        progress=True,
    )
    lines = [f"[green]+ {escape(path)}[/green]" for path in result.added]
    lines += [f"[red]- {escape(path)}[/red]" for path in result.removed]
    lines += [f"[yellow]~ {escape(path)}[/yellow]: {escape(was)} -> {escape(now)}" for path, was, now in result.retyped]
    for change in result.changed:
        numbers = "" if change.max_abs is None else f": max abs {change.max_abs:.6g}, max rel {change.max_rel:.6g}"
        lines.append(f"[yellow]* {escape(change.leaf_path)}[/yellow]{numbers}")
    for line in lines:
        out.print(line)
    counts = zip(
        ("unchanged", "changed", "retyped", "added", "removed"),
        map(len, (result.unchanged, result.changed, result.retyped, result.added, result.removed)),
    )
    summary = ", ".join(f"{n} {what}" for what, n in counts) + f" ({human_bytes(result.bytes_read)} read)"
    return _verdict(out, result.same, ("SAME", "DIFFERENT", "yellow"), summary)


def _import_t5(args: argparse.Namespace) -> int:
    from .t5 import convert_hf, convert_tf
    from .t5._hf import is_hf_directory

    if is_hf_directory(args.src):
        if args.config is not None:
            raise CheckpointError(
                f"{args.src} is a HuggingFace directory: its config.json is the config; drop --config."
            )
        config = convert_hf(args.src, args.out, dtype=args.dtype, overwrite=args.overwrite, progress=True)
    else:
        config = convert_tf(args.src, args.out, args.config, dtype=args.dtype, overwrite=args.overwrite, progress=True)
    print(
        f"wrote {args.out}: T5 {config.num_layers}+{config.num_decoder_layers} layers, d_model {config.d_model}, "
        f"vocab {config.vocab_size}"
    )
    return 0


WRITTEN_FORMATS = ("eqxckpt", "safetensors")  # what `convert --to` writes
# Extensions of files in formats eqxckpt does not write: a DST ending in one is refused
# rather than written as an eqxckpt directory of that name.
OTHER_EXTENSIONS = (
    ".bin",
    ".ckpt",
    ".h5",
    ".msgpack",
    ".npy",
    ".npz",
    ".pkl",
    ".pickle",
    ".pt",
    ".pth",
    ".gguf",
    ".onnx",
)


def written_format(dst: str, to: str | None) -> str:
    """The format `convert` writes to ``dst``: ``to`` where given, else what ``dst``'s
    extension names (``.safetensors``: safetensors; none: an eqxckpt directory). An
    extension of another format is refused: what to write there is a guess.

    ```python
    written_format("model.safetensors", None)  # 'safetensors'
    ```
    """
    if to is not None:
        return to
    name = dst.rstrip("/").rsplit("/", 1)[-1].lower()
    if name.endswith(".safetensors"):
        return "safetensors"
    other = next((ext for ext in OTHER_EXTENSIONS if name.endswith(ext)), None)
    if other is not None:
        raise CheckpointError(
            f"Cannot tell what to write at {dst}: {other} files are not a format eqxckpt writes. Pass "
            f"--to eqxckpt (a checkpoint directory) or --to safetensors, or name it otherwise. Nothing was written."
        )
    return "eqxckpt"


def _convert(args: argparse.Namespace) -> int:
    import time

    import jax

    from ._formats._open import open as open_source
    from ._formats._safetensors import save_safetensors
    from ._progress import reporting
    from ._read._lazy import LazyArray
    from ._storage import resolve
    from ._write._save import save

    sharded = args.max_shard_size is not None
    if sharded and args.max_shard_size.strip().isdigit():  # a number of bytes
        args.max_shard_size = int(args.max_shard_size)
    if sharded and args.to == "eqxckpt":
        raise CheckpointError("--max-shard-size splits a safetensors model into shards; it goes with --to safetensors.")
    to = "safetensors" if sharded else written_format(str(args.dst), args.to)
    names = _names_function(args.names) if args.names is not None else None
    if names is not None and to != "safetensors":
        raise CheckpointError("--names names the tensors of a safetensors model; it goes with --to safetensors.")
    destination = resolve(checkpoint_path(args.dst))
    if to == "safetensors" and not sharded and destination.local is None:
        # save_safetensors writes one local file: a URL would become local directories named after it.
        raise CheckpointError(
            f"Cannot write a safetensors file at {args.dst}: eqxckpt writes safetensors files to a local path "
            "only; a sharded model (--max-shard-size) goes to a bucket too. Write it locally and copy it, or "
            "convert to an eqxckpt checkpoint there (--to eqxckpt). Nothing was written."
        )
    _check_not_nested(resolve(checkpoint_path(args.src)), destination)
    source = open_source(checkpoint_path(args.src), format=args.format)
    started = time.perf_counter()
    written = len(source)
    if to == "safetensors":
        # A safetensors file holds arrays only: the rest (an Equinox model's activation
        # functions, a step number) is named in one line, not a reason to refuse.
        left_out = [
            f"{path} ({leaf.describe()})"
            for path, leaf in source.records().items()
            if not leaf.stored and not leaf.is_none
        ]
        if left_out:
            shown = ", ".join(left_out[:20]) + (f" and {len(left_out) - 20} more" if len(left_out) > 20 else "")
            print(f"left out {len(left_out)} leaves that are not arrays: {shown}", file=sys.stderr)
        arrays = jax.tree_util.tree_map(lambda x: x if isinstance(x, LazyArray) else None, source.tree())
        metadata = {k: v if isinstance(v, str) else json.dumps(v) for k, v in source.metadata.items()}
        if sharded:  # a sharded source's index says its size: the new index says its own
            metadata.pop("total_size", None)
        written = len(jax.tree_util.tree_leaves(arrays))
        with reporting(f"{args.src} -> {args.dst}", source.nbytes, written, progress=True):
            save_safetensors(
                checkpoint_path(args.dst) if sharded else args.dst,
                arrays,
                max_shard_size=args.max_shard_size,
                names=names,
                metadata=metadata or None,  # no empty __metadata__ for a source without any
                overwrite=args.overwrite,
            )
    else:
        save(
            checkpoint_path(args.dst), source.tree(), metadata=source.metadata, overwrite=args.overwrite, progress=True
        )
    print(
        f"wrote {args.dst} ({to}): {written} leaves, {human_bytes(source.nbytes)} in "
        f"{time.perf_counter() - started:.1f} s"
    )
    return 0


def _names_function(spec: str) -> "Callable[[str], str]":
    """The function ``MODULE:FUNC`` names (``--names``): the user's own code, imported."""
    import importlib

    module, _, function = spec.partition(":")
    if not module or not function:
        raise CheckpointError(f"--names takes MODULE:FUNC (e.g. mypkg.naming:hf_name), got {spec!r}.")
    try:
        found = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as e:
        raise CheckpointError(f"--names {spec}: cannot import it ({e}).") from None
    if not callable(found):
        raise CheckpointError(f"--names {spec}: {function} is not a function.")
    return typing.cast("Callable[[str], str]", found)  # each name it gives is checked as used


def _check_not_nested(src: "Storage", dst: "Storage") -> None:
    """Refuse a destination inside the source or around it (a directory, or a prefix of
    the same bucket): writing one would change the other."""

    def where(storage: "Storage") -> tuple[tuple, str]:
        if storage.local is not None:
            return ("file",), str(storage.local.resolve()).rstrip("/") + "/"
        spec = storage.kvstore
        return (spec.get("driver"), spec.get("bucket"), spec.get("endpoint")), str(spec.get("path", ""))

    (src_root, src_path), (dst_root, dst_path) = where(src), where(dst)
    if src_root == dst_root and (src_path.startswith(dst_path) or dst_path.startswith(src_path)):
        raise CheckpointError(
            f"Cannot convert {src} into {dst}: one is inside the other, so writing the copy would change the "
            "source. Write it elsewhere."
        )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``eqxckpt`` / ``python -m eqxckpt``.

    ```
    $ eqxckpt inspect ckpt/step_100 --at model
    ```
    """
    parser = argparse.ArgumentParser(
        prog="eqxckpt",
        description="Inspect, verify and convert checkpoints without the model code: eqxckpt's own, safetensors "
        "(HuggingFace), Orbax and TensorFlow. 'eqxckpt COMMAND --help' says more about each command.",
    )
    parser.add_argument("--version", action="version", version=f"eqxckpt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspect = sub.add_parser("inspect", help="print the leaves with shapes, dtypes and sizes")
    inspect.add_argument("path", help="checkpoint directory, URL (s3://bucket/prefix) or kvstore spec as JSON")
    inspect.add_argument("--at", default=None, help="only the subtree under this path prefix")
    inspect.add_argument("--format", default=None, choices=FORMATS, help="the format (default: detected)")
    inspect.set_defaults(run=_inspect)
    check = sub.add_parser("verify", help="read every chunk and check it against the manifest; exit 1 if damaged")
    check.add_argument(
        "path", help="checkpoint directory, URL or kvstore spec as JSON; a directory of checkpoints verifies each"
    )
    check.add_argument(
        "--repair",
        action="store_true",
        help="mend damaged leaves from a twin that verifies in a checkpoint beside them (a run's other steps)",
    )
    check.set_defaults(run=_verify)
    compare = sub.add_parser("diff", help="compare two checkpoints leaf by leaf (any formats); exit 1 if they differ")
    compare.add_argument("a", help="the first checkpoint: directory, file, URL or kvstore spec as JSON")
    compare.add_argument("b", help="the second checkpoint")
    compare.add_argument("--at", default=None, help="only the subtree under this path prefix")
    compare.add_argument("--format", default=None, choices=FORMATS, help="the format of A (default: detected)")
    compare.add_argument("--format-b", default=None, choices=FORMATS, help="the format of B (default: as A's)")
    compare.set_defaults(run=_diff)
    convert = sub.add_parser("convert", help="convert a checkpoint between formats (eqxckpt, safetensors)")
    convert.add_argument("src", help="checkpoint to read: eqxckpt, a .safetensors file or a HuggingFace directory")
    convert.add_argument("dst", help="where to write")
    convert.add_argument(
        "--to",
        default=None,
        choices=WRITTEN_FORMATS,
        help="the format to write (default: safetensors for a DST ending in .safetensors, else eqxckpt)",
    )
    convert.add_argument("--format", default=None, choices=FORMATS, help="the format of SRC (default: detected)")
    convert.add_argument("--overwrite", action="store_true", help="replace what is at DST")
    convert.add_argument(
        "--max-shard-size",
        default=None,
        metavar="SIZE",
        help="write DST as HuggingFace's sharded safetensors (a directory or URL): shards of at most SIZE "
        "(bytes, or e.g. 5GB), then model.safetensors.index.json",
    )
    convert.add_argument(
        "--names",
        default=None,
        metavar="MODULE:FUNC",
        help="name each tensor FUNC(leaf_path) (default: the path with / as .)",
    )
    # What every conversion to safetensors now does (the arrays, the rest named): kept so that
    # scripts written for the flag still run.
    convert.add_argument("--arrays-only", action="store_true", help=argparse.SUPPRESS)
    convert.set_defaults(run=_convert)
    t5 = sub.add_parser(
        "import-t5", help="convert a Mesh TensorFlow or HuggingFace T5 checkpoint to an eqxckpt checkpoint"
    )
    t5.add_argument(
        "src", help="TF checkpoint directory or prefix, or a HuggingFace directory (config.json + safetensors)"
    )
    t5.add_argument("out", help="where to write the eqxckpt checkpoint")
    t5.add_argument("--config", default=None, help="for TF: config.json or operative_config.gin (default: inferred)")
    t5.add_argument(
        "--dtype", default=None, help="floating weights' dtype: float32 (default), bfloat16, ..., or auto (as stored)"
    )
    t5.add_argument("--overwrite", action="store_true", help="replace a checkpoint already at OUT")
    t5.set_defaults(run=_import_t5)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (CheckpointError, OSError, KeyError) as e:
        # Whole (the hint is often on a later line), in the command line's own terms.
        message = re.sub(r"\b([Pp])ass overwrite=True", r"\1ass --overwrite", str(e))
        print(f"eqxckpt {args.command}: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
