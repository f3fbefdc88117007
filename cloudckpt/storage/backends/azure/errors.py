"""How the Azure backend classifies its failures (azure-core's errors), for the retry
policy: the HTTP status and error code of a response, the codes that mean "try
again", a connection that failed or broke, a credential that could not be had.

Judged by the classes' names in azure-core's module, so this module imports neither
azure-core nor adlfs: the registry hands :func:`classify` to the retry policy as a
fallback for failures whose backend is not named, without loading the Azure client.
"""

from __future__ import annotations

from cloudckpt.storage.retry import Classified, Failure

#: Error codes worth retrying whatever their status says.
TRANSIENT_CODES = frozenset({"ServerBusy", "OperationTimedOut", "InternalError"})


def classify(exc: BaseException) -> Classified | None:
    """What Azure says of one exception of a failure's chain (None: not the SDK's)."""
    kinds = _azure_kinds(exc)
    if "ResourceNotFoundError" in kinds:
        return Classified(Failure.NOT_FOUND, 404, getattr(exc, "error_code", None))
    status = getattr(exc, "status_code", None)
    if "HttpResponseError" in kinds and status:
        error_code = getattr(exc, "error_code", None)  # absent on errors without a body
        code = str(error_code) if error_code else None
        transient = code in TRANSIENT_CODES
        return Classified(Failure.TRANSIENT if transient else None, status, code)
    if kinds & {"ServiceRequestError", "ServiceResponseError"}:
        return Classified(Failure.TRANSIENT)  # the connection failed or broke
    if "AzureError" in kinds and "credential" in type(exc).__name__.lower():
        return Classified(Failure.NO_CREDENTIALS)
    return None


def _azure_kinds(exc: BaseException) -> set[str]:
    """The names of azure-core's exception classes ``exc`` is an instance of."""
    return {c.__name__ for c in type(exc).__mro__
            if c.__module__ == "azure.core.exceptions"}
