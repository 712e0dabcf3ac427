"""Transient API errors (``_providers/retry.py``): which errors of each provider's API are
tried again, and that a call is tried again until it works or the attempts run out. The
errors are the real clients' own (urllib's, botocore's, kubectl's and squeue's messages);
the providers' use of it runs against their labs (a 500 from the Vast stand-in in
``test_vast.py``)."""

from __future__ import annotations

import io
import socket
import urllib.error

import pytest

from flotilla._errors import ProvisionError
from flotilla._providers import retry


def _http(status: int) -> urllib.error.HTTPError:
    return urllib.error.HTTPError("http://x/api/v0/overlay/", status, "x", {}, io.BytesIO(b"{}"))  # type: ignore[arg-type]


def _boto(code: str, status: int) -> Exception:
    from botocore.exceptions import ClientError

    response = {
        "Error": {"Code": code, "Message": "m"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return ClientError(response, "RunInstances")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (_http(500), True),
        (_http(502), True),
        (_http(503), True),
        (_http(429), True),
        (_http(400), False),
        (_http(401), False),
        (_http(404), False),
        (urllib.error.URLError(ConnectionResetError(104, "Connection reset by peer")), True),
        (urllib.error.URLError(ConnectionRefusedError(111, "Connection refused")), True),
        (urllib.error.URLError(socket.gaierror(-2, "Name or service not known")), False),
        (TimeoutError("timed out"), True),
        (ConnectionResetError(104, "Connection reset by peer"), True),
        (ValueError("Expecting value: line 1 column 1"), False),
        (_boto("InternalError", 500), True),
        (_boto("RequestLimitExceeded", 503), True),
        (_boto("Unavailable", 503), True),
        (_boto("InvalidGroup.Duplicate", 400), False),
        (_boto("InsufficientInstanceCapacity", 500), False),  # the next zone, at once
        (_boto("UnauthorizedOperation", 403), False),
        (
            ProvisionError(
                "kubectl get failed: Error from server (InternalError): an error on the "
                "server has prevented the request from succeeding"
            ),
            True,
        ),
        (
            ProvisionError(
                "kubectl create failed: The connection to the server 10.0.0.1:6443 was "
                "refused - did you specify the right host or port?"
            ),
            True,
        ),
        (ProvisionError('kubectl get failed: Error from server (NotFound): pods "x"'), False),
        (
            ProvisionError("squeue: error: Unable to contact slurm controller (connect failure)"),
            True,
        ),
        (ProvisionError("squeue: error: Invalid job id specified"), False),
    ],
)
def test_which_errors_are_tried_again(error: Exception, transient: bool) -> None:
    assert retry.transient(error) is transient


def test_a_call_is_tried_again_until_it_works(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "FIRST_DELAY", 0.001)
    answers: list[Exception | str] = [_http(500), _http(503), "done"]

    def call() -> str:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert retry.retried(call, "test") == "done" and answers == []


def test_a_call_that_keeps_failing_raises_its_last_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(retry, "FIRST_DELAY", 0.001)
    calls = 0

    def call() -> None:
        nonlocal calls
        calls += 1
        raise _http(500 + 2 * (calls - 1))  # 500, 502, 504

    with pytest.raises(urllib.error.HTTPError) as raised:
        retry.retried(call, "test", attempts=3)
    assert calls == 3 and raised.value.code == 504


def test_an_error_that_is_not_transient_is_raised_at_once() -> None:
    calls = 0

    def call() -> None:
        nonlocal calls
        calls += 1
        raise _http(404)

    with pytest.raises(urllib.error.HTTPError):
        retry.retried(call, "test")
    assert calls == 1
