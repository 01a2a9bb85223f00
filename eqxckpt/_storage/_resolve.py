"""`resolve`: a user's path argument as a `Storage` of the right backend."""

import os
import pathlib
from typing import Any

from .._errors import ArgumentError, CheckpointError
from ._backend import CheckpointPath, Storage, environment_endpoint
from ._disk import LocalStorage
from ._objects import ObjectStorage


def resolve(path: CheckpointPath | Storage) -> Storage:
    """Turn a user's ``path`` argument into a `Storage`.

    Accepts a local path, a ``file://``, ``memory://``, ``s3://`` or ``gs://``
    URL, or a TensorStore kvstore spec dict (for custom endpoints).
    """
    if isinstance(path, Storage):
        return path
    if isinstance(path, dict):
        spec = dict(path)
        if not isinstance(spec.get("driver"), str) or not isinstance(spec.get("path", ""), str):
            raise ArgumentError(f"A kvstore spec needs a 'driver' (and a 'path') that are strings, got {path!r:.200}.")
        if spec["driver"] not in ("file", "memory", "s3", "gcs"):
            raise ArgumentError(
                f"A kvstore spec's driver must be 'file', 'memory', 's3' or 'gcs', got {spec['driver']!r:.100}."
            )
        spec["path"] = _as_dir(spec.get("path", ""))
        if spec["driver"] == "file":
            return LocalStorage.at(pathlib.Path(spec["path"]).absolute())
        return ObjectStorage(spec)
    given: Any = path
    if isinstance(path, os.PathLike):
        try:
            given = os.fspath(path)
        except TypeError:  # its __fspath__ returned neither str nor bytes
            given = None
    if not isinstance(given, str) or not given or "\0" in given:
        raise ArgumentError(
            f"path must be a non-empty str (no NUL), os.PathLike or kvstore spec dict, got {path!r:.200}."
        )
    path = given
    scheme, sep, rest = path.partition("://")
    if not sep:
        return LocalStorage.at(pathlib.Path(path).expanduser().absolute())
    if scheme == "file":
        return LocalStorage.at(pathlib.Path(rest).absolute())
    if scheme == "memory":
        return ObjectStorage({"driver": "memory", "path": _as_dir(rest)})
    if scheme in ("s3", "gs"):
        bucket, _, prefix = rest.partition("/")
        spec: dict[str, Any] = {"driver": "s3" if scheme == "s3" else "gcs", "bucket": bucket, "path": _as_dir(prefix)}
        if scheme == "s3":
            spec.update(_s3_environment())
        return ObjectStorage(spec)
    raise CheckpointError(
        f"Unsupported URL scheme {scheme!r} in {path!r}: use a local path, file://, memory://, s3:// or gs://, "
        "or a kvstore spec dict."
    )


def _s3_environment() -> dict[str, Any]:
    """The S3 settings AWS tools take from the environment, for ``s3://`` URLs.

    ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` point at an S3-compatible
    server; with ``AWS_ACCESS_KEY_ID`` set, credentials come from the
    environment only (never from a cloud metadata service).
    """
    spec: dict[str, Any] = {}
    endpoint = environment_endpoint()
    if endpoint:
        spec["endpoint"] = endpoint
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        spec["aws_region"] = region
    if os.environ.get("AWS_ACCESS_KEY_ID"):
        spec["aws_credentials"] = {"type": "environment"}
    return spec


def _as_dir(prefix: str) -> str:
    prefix = prefix.strip("/") if not prefix.startswith("/") else prefix.rstrip("/")
    return prefix + "/" if prefix else ""
