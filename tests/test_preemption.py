"""Preemption notices (eqxckpt/_preemption.py): one process-wide listener that managers
join and leave, a program's own handlers kept, and no signal swallowed. Most run a
real Python process that sends itself SIGTERM and check how it ended."""

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from hypothesis import given, settings, strategies as st

import eqxckpt
from eqxckpt._run import _preemption
from eqxckpt._run._preemption import Preemption


def run(script: str) -> subprocess.CompletedProcess:
    """Run ``script`` in a fresh Python process (JAX on the CPU); its output and status."""
    code = "import gc, os, signal, sys, time\nimport numpy as np\nimport eqxckpt\n" + textwrap.dedent(script)
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("chain", [False, True])
def test_a_handler_the_program_sets_after_the_first_save_survives_close(tmp_path, chain):
    """Closing the manager leaves the program's handler in place: SIGTERM runs it. If it
    calls the one it found (eqxckpt's), that one does what the disposition it replaced
    would have: SIGTERM's default ends the process."""
    done = run(f"""
        got = []
        def program(signum, frame):
            got.append(signum)
            if {chain} and callable(found):
                found(signum, frame)
        with eqxckpt.CheckpointManager({str(tmp_path / "run")!r}) as manager:
            manager.save(0, {{"w": np.zeros(2)}})
            found = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, program)
        print("kept", signal.getsignal(signal.SIGTERM) is program, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
        print("program handler ran", got, flush=True)
        sys.exit(3)  # the program's own decision
    """)
    if chain:
        assert done.returncode == -signal.SIGTERM, done.stderr
        assert done.stdout.splitlines() == ["kept True"]
    else:
        assert done.returncode == 3, done.stderr
        assert done.stdout.splitlines() == ["kept True", f"program handler ran [{int(signal.SIGTERM)}]"]


@pytest.mark.multiprocess
def test_closing_one_manager_leaves_another_listening(tmp_path):
    """A and B listen; A closes first; SIGTERM: B's next save saves its step for the notice
    (the interval would not have saved it)."""
    done = run(f"""
        with eqxckpt.CheckpointManager({str(tmp_path / "b")!r}, save_interval_steps=10, exit_on_preemption=False) as b:
            with eqxckpt.CheckpointManager({str(tmp_path / "a")!r}) as a:
                a.save(0, {{"w": np.zeros(2)}})  # A listens first
                b.save(0, {{"w": np.zeros(2)}})
            os.kill(os.getpid(), signal.SIGTERM)  # A is closed
            print("saved", b.save(1, {{"w": np.ones(2)}}), b.reached_preemption(1), flush=True)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["saved True True"]
    assert eqxckpt.CheckpointManager(tmp_path / "b").all_steps() == [0, 1]
    assert (eqxckpt.load(tmp_path / "b" / "1")["w"] == 1).all()
    assert eqxckpt.CheckpointManager(tmp_path / "a").all_steps() == [0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("blocking", [False, True])
def test_a_manager_dropped_unclosed_stops_listening(tmp_path, blocking):
    """``del manager`` (garbage-collected, never closed): SIGTERM then ends the process as
    it would have without eqxckpt."""
    done = run(f"""
        manager = eqxckpt.CheckpointManager({str(tmp_path / "run")!r}, blocking={blocking})
        manager.save(0, {{"w": np.zeros(2)}})
        manager.wait()
        del manager
        gc.collect()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
        print("still running", flush=True)
    """)
    assert done.returncode == -signal.SIGTERM and "still running" not in done.stdout, done.stderr
    assert eqxckpt.CheckpointManager(tmp_path / "run").all_steps() == [0]


@pytest.mark.multiprocess
def test_a_notice_no_save_answers_ends_the_process_after_the_grace_period(tmp_path):
    """A manager never closed, a notice, and no save after it (the loop had ended): the
    process ends as SIGTERM would have, after the save in flight committed."""
    done = run(f"""
        manager = eqxckpt.CheckpointManager({str(tmp_path / "run")!r}, preemption_grace_s=1)
        manager.save(0, {{"w": np.zeros(2)}})
        manager.save(1, {{"w": np.ones((1024, 1024), np.float32)}})  # in the background
        os.kill(os.getpid(), signal.SIGTERM)
        print("evaluating", flush=True)
        time.sleep(60)
        print("still running", flush=True)
    """)
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert done.stdout.splitlines() == ["evaluating"]
    assert "SIGTERM received and no checkpoint saved for it" in done.stderr
    assert eqxckpt.CheckpointManager(tmp_path / "run").all_steps() == [0, 1]
    assert eqxckpt.verify(tmp_path / "run" / "1").ok


@pytest.mark.multiprocess
def test_a_save_for_the_notice_outlasting_the_grace_period_completes(tmp_path):
    """The grace period does not end the process under the save for the notice (made slow:
    its progress callback sleeps past the grace period; it has one more grace period), and
    a notice that save answered ends nothing later. The grace period (3 s) leaves the save time to start on a loaded
    machine: only its start must come within it."""
    done = run(f"""
        manager = eqxckpt.CheckpointManager(
            {str(tmp_path / "run")!r}, save_interval_steps=10, exit_on_preemption=False, preemption_grace_s=3
        )
        manager.save(0, {{"w": np.zeros(2)}})
        noticed = time.monotonic()
        os.kill(os.getpid(), signal.SIGTERM)
        slow = lambda *counts: time.sleep(max(0.0, noticed + 3.5 - time.monotonic()))
        print("saved", manager.save(1, {{"w": np.ones(2)}}, progress=slow), manager.reached_preemption(1), flush=True)
        print("outlasted", time.monotonic() > noticed + 3, flush=True)
        time.sleep(3.5)  # past another grace period
        print("still running", flush=True)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["saved True True", "outlasted True", "still running"]
    assert eqxckpt.CheckpointManager(tmp_path / "run").all_steps() == [0, 1]
    assert eqxckpt.verify(tmp_path / "run" / "1").ok


@pytest.mark.multiprocess
def test_a_failed_save_for_the_notice_leaves_it_standing(tmp_path):
    """The step's directory holds someone else's files: the save for the notice fails, the
    notice stands, and the next save (a step the interval skips) saves for it."""
    (tmp_path / "run" / "2").mkdir(parents=True)
    (tmp_path / "run" / "2" / "notes.txt").write_text("not a checkpoint")
    done = run(f"""
        import warnings
        warnings.simplefilter("ignore")  # the manager warns about run/2
        manager = eqxckpt.CheckpointManager({str(tmp_path / "run")!r}, save_interval_steps=10, exit_on_preemption=False)
        with manager:
            manager.save(0, {{"w": np.zeros(2)}})
            manager.wait()
            os.kill(os.getpid(), signal.SIGTERM)
            try:
                manager.save(2, {{"w": np.full(2, 2.0)}})
            except eqxckpt.CheckpointExistsError as e:
                print("failed", type(e).__name__, flush=True)
            print("reached", manager.reached_preemption(2), manager.reached_preemption(3), flush=True)
            print("saved", manager.save(3, {{"w": np.full(2, 3.0)}}), manager.reached_preemption(3), flush=True)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["failed CheckpointExistsError", "reached False False", "saved True True"]
    assert (tmp_path / "run" / "2" / "notes.txt").read_text() == "not a checkpoint"
    with pytest.warns(UserWarning, match="not committed steps"):
        steps = eqxckpt.CheckpointManager(tmp_path / "run").all_steps()
    assert steps == [0, 3] and (eqxckpt.load(tmp_path / "run" / "3")["w"] == 3).all()


def test_preemption_grace_s_must_be_a_positive_number(tmp_path):
    for bad in (0, -1.0, float("inf"), float("nan"), True, "30"):
        with pytest.raises(ValueError, match="preemption_grace_s"):
            eqxckpt.CheckpointManager(tmp_path, preemption_grace_s=bad)


# -- in this process, with SIGUSR1 (its default would end pytest: a handler is set first) --


@contextlib.contextmanager
def fresh_listener():
    """A listener of its own, with SIGUSR1 caught by a handler that counts; put back after."""
    calls: list[str] = []
    saved_listener, saved_handler = _preemption.LISTENER, signal.getsignal(signal.SIGUSR1)
    _preemption.LISTENER = _preemption._Listener()
    signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append("original"))
    try:
        yield calls
    finally:
        _preemption.LISTENER = saved_listener
        signal.signal(signal.SIGUSR1, saved_handler)


OPS = st.lists(
    st.one_of(
        st.just(("open",)),
        st.tuples(st.just("close"), st.integers(0, 5)),
        st.tuples(st.just("program"), st.booleans()),
        st.just(("send",)),
    ),
    max_size=14,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS)
def test_listening_composes_with_other_managers_and_the_programs_handlers(ops):
    """Any order of managers starting and stopping to listen, and of the program setting
    handlers (calling the one they found, or not): each signal calls exactly the handlers it
    would call without eqxckpt; every listening manager hears it exactly when eqxckpt's
    handler is in the chain the signal runs (always, unless a handler set after the first
    listener does not chain), no closed one ever does; when all have stopped, the handler
    is the one the program would have without eqxckpt."""
    with fresh_listener() as calls:
        listener = _preemption.LISTENER
        members: list[Preemption] = []
        closed: list[Preemption] = []
        # Without eqxckpt: the program's current handler and, per handler, the one it found.
        current, found_without, chains = "original", {}, {"original": False}
        real_found = {}  # the program's handlers: what each found, whether it calls it
        names = {signal.getsignal(signal.SIGUSR1): "original"}
        for n, op in enumerate(ops):
            if op[0] == "open":
                members.append(Preemption((signal.SIGUSR1,), 30.0))
            elif op[0] == "close" and members:
                member = members.pop(op[1] % len(members))
                member.close()
                closed.append(member)
            elif op[0] == "program":
                name = f"program{n}"
                found = signal.getsignal(signal.SIGUSR1)

                def program(signum, frame, name=name, found=found, chain=op[1]):
                    calls.append(name)
                    if chain and callable(found):
                        found(signum, frame)

                real_found[program], names[program] = (found, op[1]), name
                signal.signal(signal.SIGUSR1, program)
                found_without[name], chains[name], current = current, op[1], name
            elif op[0] == "send":
                # Whether eqxckpt's handler is in the chain the signal runs.
                handler, reached = signal.getsignal(signal.SIGUSR1), False
                while handler is not None:
                    if handler is listener.handler:
                        reached = True
                        break
                    found, chain = real_found.get(handler, (None, False))
                    handler = found if chain else None
                for member in members + closed:
                    member.noticed = False
                calls.clear()
                os.kill(os.getpid(), signal.SIGUSR1)
                expected, name = [], current
                while name is not None:
                    expected.append(name)
                    name = found_without.get(name) if chains[name] else None
                assert calls == expected
                assert all(member.noticed == reached for member in members)
                assert not any(member.noticed for member in closed)
        for member in members:
            member.close()
        assert names.get(signal.getsignal(signal.SIGUSR1)) == current


@pytest.mark.multiprocess
def test_a_program_handler_that_calls_eqxckpts_gets_the_grace_period(tmp_path):
    """The program sets its handler after the manager's first save and calls the one it
    found (as submitit and torch elastic do); the loop then stops saving: the notice is
    not swallowed, the process ends by SIGTERM once ``preemption_grace_s`` is over (it
    lived on until the next save, or for good once the manager was closed)."""
    done = run(f"""
        manager = eqxckpt.CheckpointManager({str(tmp_path / "run")!r}, preemption_grace_s=1.0)
        manager.save(0, {{"w": np.zeros(2)}})
        found = signal.getsignal(signal.SIGTERM)
        def program(signum, frame):
            print("program handler", flush=True)
            found(signum, frame)
        signal.signal(signal.SIGTERM, program)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(600):  # evaluation: no more saves
            time.sleep(0.1)
        print("still running", flush=True)
    """)
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert "still running" not in done.stdout and "program handler" in done.stdout
    assert "within preemption_grace_s" in done.stderr


@pytest.mark.multiprocess
def test_a_worker_forked_after_the_first_save_dies_on_sigterm(tmp_path):
    """A worker forked after the manager's first save (a data loader's) inherits the
    handler but none of the parent's managers: SIGTERM ends it (it ignored SIGTERM for
    good: the watchdog that would end it is a thread, which a fork does not copy)."""
    done = run(f"""
        with eqxckpt.CheckpointManager({str(tmp_path / "run")!r}, preemption_grace_s=1.0) as manager:
            manager.save(0, {{"w": np.zeros(2)}})
            pid = os.fork()
            if pid == 0:
                for _ in range(600):
                    time.sleep(0.1)
                os._exit(7)
            time.sleep(0.2)
            os.kill(pid, signal.SIGTERM)
            _, status = os.waitpid(pid, 0)
            print("worker", os.waitstatus_to_exitcode(status), flush=True)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"worker {-signal.SIGTERM}"]


@pytest.mark.multiprocess
def test_a_signal_the_program_ignores_is_no_notice(tmp_path):
    """SIGTERM set to SIG_IGN by the program: the manager does not listen for it (a save
    after SIGTERM is a plain save, the process goes on), and SIG_IGN is still set after."""
    done = run(f"""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        with eqxckpt.CheckpointManager({str(tmp_path / "run")!r}, save_interval_steps=10) as manager:
            manager.save(0, {{"w": np.zeros(2)}})
            os.kill(os.getpid(), signal.SIGTERM)
            print("saved", manager.save(1, {{"w": np.ones(2)}}), manager.reached_preemption(1), flush=True)
        print("ignored", signal.getsignal(signal.SIGTERM) == signal.SIG_IGN, flush=True)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["saved False False", "ignored True"]


@pytest.mark.multiprocess
def test_a_notice_while_a_save_waits_on_a_store_that_stopped_answering_still_ends_the_process(tmp_path, s3):
    """#53 defect 2: SIGTERM with a background save in flight to an S3 server that stopped
    answering (a proxy on 127.0.0.1, paused): the process lived on for as long as the store
    stalled. Past the grace period the saves running get one more; then the process ends
    as SIGTERM would have, naming the save it gave up on (committed whole only if it had written its commit)."""
    from conftest import PausableProxy, s3_spec

    endpoint, _ = s3
    proxy = PausableProxy(endpoint)
    prefix = f"stalled-{os.getpid()}-{time.monotonic_ns()}/"
    go = tmp_path / "go"
    code = "import os, signal, sys, time\nimport numpy as np\nimport eqxckpt\n" + textwrap.dedent(f"""
        manager = eqxckpt.CheckpointManager({s3_spec(proxy.endpoint, prefix)!r}, preemption_grace_s=2)
        manager.save(0, {{"w": np.zeros(4)}})
        manager.wait()
        print("saved", flush=True)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.02)
        manager.save(1, {{"w": np.ones(4)}})  # in the background: its first request never answered
        print("saving", flush=True)
        for _ in range(3000):  # a trainer's main thread, back in Python between steps
            time.sleep(0.1)
        print("still running", flush=True)
    """)
    worker = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline() == "saved\n"
        proxy.pause()
        go.touch()
        assert worker.stdout.readline() == "saving\n"
        worker.send_signal(signal.SIGTERM)
        out, err = worker.communicate(timeout=120)  # hung until the store answered, before
    finally:
        worker.kill()
        proxy.resume()
    assert worker.returncode == -signal.SIGTERM, err
    assert out == "" and "Gave up on the saves still running" in err and prefix + "1" in err
    assert "committed whole only if it had written its commit" in err
    with eqxckpt.CheckpointManager(s3_spec(endpoint, prefix)) as manager:
        assert manager.all_steps() == [0]
    proxy.close()
