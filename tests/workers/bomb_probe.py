"""Run one reader on a (crafted) checkpoint in a fresh process; print what it raised and its peak memory.

    python bomb_probe.py OP PATH     OP: load | get | slice | verify | open, or several: load,get,verify

``slice`` reads ``[3:7]`` of every array leaf lazily (a selection: only its chunks).

Prints one JSON line per operation: {"op": OP, "error": class name or null, "message": ...,
"peak_mib": peak RSS growth during the operation}. PATH may be a URL (s3://, gs://), its
endpoint taken from the environment. A crash (abort, OOM kill) shows as a non-zero exit.
"""

import json
import sys

import eqxckpt

# The package imports these (and JAX) on first use: import them now, so the peak measured is the operation's.
eqxckpt.load, eqxckpt.open, eqxckpt.verify  # noqa: B018


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def main(names: str, path: str) -> None:
    for op in names.split(","):
        run(op, path)


def run(op: str, path: str) -> None:
    ops = {
        "load": lambda: eqxckpt.load(path),
        "get": lambda: [
            leaf.get() for leaf in (eqxckpt.open(path)[p] for p in eqxckpt.open(path).paths) if hasattr(leaf, "get")
        ],
        "slice": lambda: [
            leaf[3:7].get()
            for leaf in (eqxckpt.open(path)[p] for p in eqxckpt.open(path).paths)
            if getattr(leaf, "ndim", 0)
        ],
        "verify": lambda: eqxckpt.verify(path),
        "open": lambda: eqxckpt.open(path),
    }
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak: only the operation counts
    before = rss_kib("VmRSS")
    error = None
    try:
        result = ops[op]()
        if isinstance(result, eqxckpt.VerifyReport) and not result.ok:
            error = ("VerifyReport", str(result))
    except eqxckpt.CheckpointError as e:
        error = (type(e).__name__, str(e))
    peak = (rss_kib("VmHWM") - before) / 1024
    print(json.dumps({"op": op, "error": error and error[0], "message": error and error[1], "peak_mib": peak}))


if __name__ == "__main__":
    main(*sys.argv[1:])
