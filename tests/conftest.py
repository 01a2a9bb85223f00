import os
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from eqxckpt._tree import is_prng_key_dtype


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="run the long fault-injection and fuzz loops")


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
