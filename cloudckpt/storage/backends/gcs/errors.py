"""How the GCS backend classifies its failures (gcsfs's and google-auth's errors),
for the retry policy: gcsfs's ``HttpError`` carries its status as ``code``, a 403
comes as a bare ``OSError("Forbidden: ...")``, and a failed token refresh (the
metadata server or OAuth endpoint busy) is a hiccup of the token service, not bad
credentials, though gcsfs reports it as a 401.

Duck-typed by attribute and class name, so this module imports neither gcsfs nor
google-auth: the registry hands :func:`classify` to the retry policy as a fallback
for failures whose backend is not named, without loading the GCS client.
"""

from __future__ import annotations

from cloudckpt.storage.retry import Classified, Failure


def classify(exc: BaseException) -> Classified | None:
    """What GCS says of one exception of a failure's chain (None: not gcsfs's)."""
    if type(exc) is OSError and exc.errno is None and str(exc).startswith("Forbidden: "):
        return Classified(status=403)
    if (type(exc).__module__.startswith("google.auth")
            and type(exc).__name__ in ("RefreshError", "TransportError")):
        return Classified(Failure.TRANSIENT)
    code = getattr(exc, "code", None)  # gcsfs HttpError
    # (not aiohttp's HttpProcessingError family: a body cut short is
    # ContentLengthError/ClientPayloadError with code=400, not an HTTP 400)
    if _is_aiohttp(exc):
        code = None
    if isinstance(code, int) and 100 <= code < 600:
        return Classified(status=code)
    return None


def _is_aiohttp(exc: BaseException) -> bool:
    return type(exc).__module__.split(".")[0] == "aiohttp" and not hasattr(exc, "status")
