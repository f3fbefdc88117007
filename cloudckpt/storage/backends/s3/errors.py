"""How the S3 backend classifies its failures (botocore's errors), for the retry
policy: the HTTP status and error code a response carried, the codes that mean
"try again", botocore's connection failures, and what fails before any request
is sent (no credentials, an invalid parameter).

Duck-typed by attribute and class name, so this module imports neither botocore
nor s3fs: the registry hands :func:`classify` to the retry policy as a fallback
for failures whose backend is not named, without loading the S3 client.
"""

from __future__ import annotations

from typing import Any

from cloudckpt.storage.retry import Classified, Failure

#: Error codes worth retrying where the response gave no status.
TRANSIENT_CODES = frozenset({
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "TooManyRequests",
    "RequestLimitExceeded",
    "RequestTimeout",
    "InternalError",
    "ServiceUnavailable",
    "OperationAborted",
})
#: Codes worth retrying whatever the status: a conditional write that raced another
#: operation on the key (409; AWS says to retry it: it was neither applied nor lost).
RETRY_ANY_STATUS = frozenset({"ConditionalRequestConflict"})
#: An upload whose body the server found other than its checksum (or signed SHA-256)
#: says: damaged on the way. The client still holds the right bytes, so sending them
#: again, checksum and all, is worth it; a CompleteMultipartUpload's BadDigest (a part
#: list disagreeing with the parts) is not.
DAMAGED_BODY = frozenset({"BadDigest", "XAmzContentSHA256Mismatch"})
_UPLOADS = frozenset({"PutObject", "UploadPart"})
#: botocore's names for a connection that failed or broke.
_CONNECTION_WORDS = ("Connection", "Timeout", "Payload", "Disconnected", "IncompleteRead",
                     "ReadTimeout", "ProxyError")
_NO_CREDENTIALS_HINT = (
    "Set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, ~/.aws, an instance "
    "role), or pass the key and secret storage options")


def classify(exc: BaseException) -> Classified | None:
    """What S3 says of one exception of a failure's chain (None: not botocore's)."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore's ClientError
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = response.get("Error", {}).get("Code")
        status = int(status) if status else None
        code = str(code) if code else None
        transient = ((status is None and code in TRANSIENT_CODES) or code in RETRY_ANY_STATUS
                     or (code in DAMAGED_BODY
                         and getattr(exc, "operation_name", None) in _UPLOADS))
        return Classified(Failure.TRANSIENT if transient else None, status, code)
    name = type(exc).__name__
    if name in ("NoCredentialsError", "PartialCredentialsError"):  # before any request
        return Classified(Failure.NO_CREDENTIALS, hint=_NO_CREDENTIALS_HINT)
    if name == "ParamValidationError":  # botocore refused a parameter, before sending
        return Classified(Failure.INVALID)
    if type(exc).__module__.split(".")[0] == "botocore" and any(
            w in name for w in _CONNECTION_WORDS):
        return Classified(Failure.TRANSIENT)
    return None


def error_code(exc: BaseException) -> str | None:
    """The S3 error code of ``exc`` or its causes (``"PreconditionFailed"``), else the
    HTTP status of the first response, as a string."""
    e: BaseException | None = exc
    while e is not None:
        response: Any = getattr(e, "response", None)
        if isinstance(response, dict):
            return response.get("Error", {}).get("Code") or str(
                response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")
            )
        e = e.__cause__
    return None
