"""What each failure of an object request is (``tiers.object.faults``), and the one fault Ceph RGW here cannot make:
throttling (503 SlowDown; Pacific's radosgw has no rate limits). For that, a loopback HTTP server that answers every
request as a throttling S3 store does, reached through the same boto3 client as any store."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from botocore import exceptions as bex
from tests.tiers.object.handlers import COOLDOWN_S, FakeClock, Handler, keys, load, run, small_breaker

from kvoffload.config import ObjectTierConfig
from kvoffload.tiers.lower.block_format import CorruptBlockError, UnauthenticBlockError
from kvoffload.tiers.object.faults import Fault, classify, is_missing


def client_error(code: str, status: int) -> bex.ClientError:
    return bex.ClientError({"Error": {"Code": code, "Message": code},
                            "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


@pytest.mark.parametrize("error, fault", [
    (client_error("SlowDown", 503), Fault.THROTTLED),
    (client_error("ServiceUnavailable", 503), Fault.THROTTLED),
    (client_error("TooManyRequests", 429), Fault.THROTTLED),
    (client_error("AccessDenied", 403), Fault.DENIED),
    (client_error("ExpiredToken", 400), Fault.DENIED),
    (client_error("SignatureDoesNotMatch", 403), Fault.DENIED),
    (client_error("NoSuchBucket", 404), Fault.NO_BUCKET),
    (client_error("404", 404), Fault.NO_BUCKET),  # a HeadBucket's bare 404
    (client_error("InternalError", 500), Fault.ERROR),
    (bex.NoCredentialsError(), Fault.DENIED),
    (bex.ReadTimeoutError(endpoint_url="http://s3"), Fault.TIMEOUT),
    (bex.ConnectTimeoutError(endpoint_url="http://s3"), Fault.TIMEOUT),
    (bex.EndpointConnectionError(endpoint_url="http://s3"), Fault.UNREACHABLE),
    (CorruptBlockError("x"), Fault.CORRUPT),
    (UnauthenticBlockError("x"), Fault.UNAUTHENTIC),
    (RuntimeError("a bug"), Fault.ERROR),
], ids=lambda v: v.name if isinstance(v, Fault) else type(v).__name__)
def test_each_failure_has_its_kind(error: BaseException, fault: Fault) -> None:
    assert classify(error) is fault


def test_only_a_missing_object_is_a_miss() -> None:
    assert is_missing(client_error("NoSuchKey", 404)) and is_missing(client_error("404", 404))
    assert not is_missing(client_error("NoSuchBucket", 404)) and not is_missing(client_error("AccessDenied", 403))


def test_what_opens_the_breaker_at_once_and_what_never_counts() -> None:
    at_once = {f for f in Fault if f.at_once}
    assert at_once == {Fault.TIMEOUT, Fault.THROTTLED, Fault.DENIED, Fault.NO_BUCKET}
    assert {f for f in Fault if not f.is_server_fault} == {Fault.CORRUPT, Fault.UNAUTHENTIC}


class _Throttling(BaseHTTPRequestHandler):
    """Every request answered as S3 answers one it throttles."""

    requests = 0

    def _slow_down(self) -> None:
        type(self).requests += 1
        body = b"<?xml version='1.0'?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>" \
               b"</Error>"
        self.send_response(503)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body) if self.command != "HEAD" else 0))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _slow_down

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def throttling() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Throttling)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_throttling_store_switches_the_tier_off_at_once_and_jobs_then_send_nothing(
        throttling: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    config = small_breaker(ObjectTierConfig(bucket="kvoffload-throttled", endpoint=throttling))
    clock = FakeClock()
    _Throttling.requests = 0
    with Handler(config, clock=clock) as h:
        assert h.faults.counts[Fault.THROTTLED] == 1 and h.breaker.is_open  # its start-up HeadBucket
        sent = _Throttling.requests
        result = run(h, load(keys(2), (0, 1)))
        assert not result.success and _Throttling.requests == sent  # backed off: not one more request
        clock.now += COOLDOWN_S
        result = run(h, load(keys(2), (0, 1)))
        assert not result.success and _Throttling.requests > sent  # tried again after the cool-down ...
        assert h.breaker.is_open and h.breaker.trips == 2  # ... and off again at the first 503
