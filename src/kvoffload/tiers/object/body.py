"""Reading a GET's answer into a buffer the caller keeps: the object tier's loads (``ObjectHandler._get``).

botocore's ``StreamingBody.read(n)`` returns a new ``bytes`` object per answer, and its ``readinto`` is urllib3's,
which reads a new ``bytes`` and copies it into the buffer. ``read_into`` has the socket's bytes land in the caller's
buffer with no copy between: it reads through the ``http.client`` response under urllib3's (``_fp``, a private
attribute of urllib3 1.x and 2.x), whose ``readinto`` receives straight into the buffer, and hands the connection
back to the pool as urllib3 would. Where the answer has no such response (another urllib3, a test's stub), it reads
with ``StreamingBody.read`` and copies: slower, the same result.

Either way an answer is read no further than the buffer: a server sending more than was asked (a 5 GiB body to a
4 MiB GET) costs one buffer's read, and the connection is dropped (closed, never returned to the pool) instead of
being drained. An answer that breaks off before the length its header announced is a failed request
(``AnswerCutShort``), never a short object: the connection failed, not the object.
"""

from __future__ import annotations

import http.client
from typing import Any


class AnswerCutShort(ConnectionError):
    """The connection ended before the answer's announced length arrived (reset, or shut at a deadline)."""


def read_into(body: Any, buffer: memoryview) -> int:
    """Read ``body`` (a GET answer's ``StreamingBody``) into the start of ``buffer``, until the buffer is full or
    the answer ends, and let go of the body: a whole answer's connection goes back to the pool, any other is closed.

    Returns:
        The bytes read: the answer's length, or ``len(buffer)`` when the answer is at least that long.
    Raises:
        AnswerCutShort: the answer ended before its announced length.
        Exception: the read failed (a socket error or timeout; botocore's errors on the fallback path).
    """
    response = _http_response(body)
    if response is None:
        return _read_copied(body, buffer)
    try:
        got = _receive(response, buffer)
    except BaseException:
        body.close()  # drops the connection: a broken answer's rest is never read
        raise
    if response.isclosed():  # every byte announced was read: the connection is clean, as urllib3 would reuse it
        body._raw_stream.release_conn()
    else:
        body.close()  # an answer longer than the buffer: its rest is never read, its connection never reused
    return got


def _http_response(body: Any) -> http.client.HTTPResponse | None:
    """The ``http.client`` response under ``body``, or None where this botocore and urllib3 have none to give."""
    raw = getattr(body, "_raw_stream", None)
    response = getattr(raw, "_fp", None)
    if not isinstance(response, http.client.HTTPResponse) or not callable(getattr(raw, "release_conn", None)):
        return None
    return response


def _receive(response: http.client.HTTPResponse, buffer: memoryview) -> int:
    got = 0
    try:
        while got < len(buffer):
            n = response.readinto(buffer[got:])  # at most what the answer announced; blocks until some arrived
            if not n:
                break
            got += n
    except http.client.HTTPException as e:  # a chunked answer that broke off or lies about its chunks
        raise AnswerCutShort(f"the answer broke off after {got} bytes: {e!r}") from e
    if got < len(buffer) and response.length:  # what its header announced is still to come: the connection ended
        raise AnswerCutShort(f"the answer broke off after {got} bytes, {response.length} short of its length")
    return got


def _read_copied(body: Any, buffer: memoryview) -> int:
    got = 0
    try:
        while got < len(buffer):
            data = body.read(len(buffer) - got)  # an empty read checks the length (botocore's IncompleteReadError)
            if not data:
                break
            buffer[got:got + len(data)] = data
            got += len(data)
    finally:
        body.close()  # after a whole answer its connection is back in the pool already; else it is dropped
    return got
