"""What went wrong with an object request, in a few named kinds (``tiers.lower.fault_log.FaultLog`` logs each once
per outage).

boto3 raises ``botocore.exceptions.ClientError`` for an answer of the server (its code and HTTP status say what) and
other ``BotoCoreError``s for a server that never answered (refused, reset, timed out) or credentials that could not
be found. A missing object is no fault (``is_missing``): the job fails as a miss.
"""

from __future__ import annotations

from typing import Any

from kvoffload.tiers.lower.block_format import CorruptBlockError, UnauthenticBlockError
from kvoffload.tiers.lower.fault_log import TierFault


class Fault(TierFault):
    UNREACHABLE = "object store unreachable"
    TIMEOUT = "object store too slow (request timeout)"
    THROTTLED = "object store throttling (503 SlowDown)"
    DENIED = "access denied (credentials missing, wrong or expired, or no permission)"
    NO_BUCKET = "bucket missing"
    CORRUPT = "damaged object"
    UNAUTHENTIC = "object failed authentication"
    ERROR = "object store error"

    @property
    def is_server_fault(self) -> bool:
        """Counts towards the breaker: the store or the way to it is failing, not one object (anyone who may write
        the bucket can plant a bad object: counted, a few would switch the tier off for every engine)."""
        return self not in (Fault.CORRUPT, Fault.UNAUTHENTIC)

    @property
    def at_once(self) -> bool:
        """Switches the tier off without waiting for ``breaker_errors``: every next request would meet it too
        (and a throttling store needs requests to back off now)."""
        return self in (Fault.TIMEOUT, Fault.THROTTLED, Fault.DENIED, Fault.NO_BUCKET)


_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "TokenRefreshRequired",
           "InvalidToken", "RequestTimeTooSkewed", "AllAccessDisabled"}
_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
              "ServiceUnavailable"}
_MISSING = {"NoSuchKey", "404", "NotFound"}


def error_code(error: BaseException) -> str:
    """The S3 error code of a ``ClientError`` ("" for anything else)."""
    return _code(error)[0]


def _code(error: BaseException) -> tuple[str, int]:
    response: Any = getattr(error, "response", None)
    if not isinstance(response, dict):
        return "", 0
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def is_missing(error: BaseException) -> bool:
    """The object is not there (404 of a GET or HEAD; a missing bucket is a fault, not a miss)."""
    code, status = _code(error)
    return code in _MISSING or (status == 404 and code != "NoSuchBucket")


def classify(error: BaseException) -> Fault:
    """The kind of a job's failure (anything unexpected is ``ERROR``)."""
    from botocore import exceptions as bex

    if isinstance(error, UnauthenticBlockError):
        return Fault.UNAUTHENTIC
    if isinstance(error, CorruptBlockError):
        return Fault.CORRUPT
    if isinstance(error, bex.ClientError):
        code, status = _code(error)
        if code == "NoSuchBucket" or status == 404:
            # A missing object is a miss (``is_missing``), never classified; a 404 here is a HeadBucket's, whose
            # answer has no body to name its code.
            return Fault.NO_BUCKET
        if code in _DENIED or status in (401, 403):
            return Fault.DENIED
        if code in _THROTTLED or status in (429, 503):
            return Fault.THROTTLED
        return Fault.ERROR
    if isinstance(error, bex.NoCredentialsError | bex.PartialCredentialsError | bex.CredentialRetrievalError):
        return Fault.DENIED
    if isinstance(error, bex.ReadTimeoutError | bex.ConnectTimeoutError | TimeoutError):
        return Fault.TIMEOUT
    if isinstance(error, bex.EndpointConnectionError | bex.ConnectionError | bex.HTTPClientError | OSError):
        return Fault.UNREACHABLE
    return Fault.ERROR
