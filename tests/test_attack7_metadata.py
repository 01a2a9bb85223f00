"""Leaf metadata read on its own threads (attack 7): after a fork, and at exit."""

import subprocess
import sys
import textwrap

import pytest

PRELUDE = """
import atexit, os, signal, sys, time, warnings
import numpy as np
import eqxckpt
warnings.simplefilter("ignore")
where = sys.argv[1]
tree = {"a": np.arange(50000.0, dtype=np.float32), "b": np.ones(30000, np.float32)}
like = {k: np.zeros_like(v) for k, v in tree.items()}
eqxckpt.save(where, tree)
def check():
    got = eqxckpt.load(where, like=like)
    return all(np.array_equal(got[k], tree[k]) for k in tree)
"""


def run(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = PRELUDE + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "c")], capture_output=True, text=True, timeout=120
    )


@pytest.mark.multiprocess
def test_a_child_forked_after_a_load_loads(tmp_path):
    # The parent's metadata threads are not in the child: a pool made before the fork
    # would take the child's work and never run it (the load waited for ever).
    done = run(
        tmp_path,
        """
        print("parent", check(), flush=True)
        for _ in range(3):
            time.sleep(0.2)
            pid = os.fork()
            if pid == 0:
                signal.alarm(30)
                print("child", check(), flush=True)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            print("status", os.waitstatus_to_exitcode(status), flush=True)
        """,
    )
    assert done.stdout.splitlines() == ["parent True"] + ["child True", "status 0"] * 3, done.stderr


@pytest.mark.multiprocess
def test_a_load_at_exit_loads(tmp_path):
    # atexit handlers run after concurrent.futures stopped taking work at shutdown.
    done = run(tmp_path, 'atexit.register(lambda: print("at exit", check(), flush=True))\n')
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["at exit True"], done.stderr
