"""TensorStore as eqxckpt uses it (`_tensorstore`): one context, and its errors read."""

from eqxckpt._tensorstore import is_storage_error, reason, shared_context


def test_one_context_for_the_process():
    assert shared_context() is shared_context()


def test_storage_errors_are_told_apart_and_their_reason_kept():
    failed = ValueError('NOT_FOUND: Error reading "a/zarr.json" [tensorstore_spec={"driver": "file"}]')
    assert is_storage_error(failed)
    assert reason(failed) == 'NOT_FOUND: Error reading "a/zarr.json"'
    assert reason("UNAVAILABLE: no route [http_response_body=<html>]") == "UNAVAILABLE: no route"
    assert not is_storage_error(ValueError("shape mismatch"))
    assert not is_storage_error(OSError("NOT_FOUND: x"))
