"""What the GCS backend makes of its storage options: whether gcsfs would search for
credentials itself and whether any are there to find (so that a host without them
fails at once rather than after google-auth's long probe), and a token masked in
what an error quotes."""

from __future__ import annotations

import http.client
import os
from typing import Any

from cloudckpt.errors import AccessDeniedError
from cloudckpt.storage.retry import mask_secrets


def searches_credentials(options: dict[str, Any]) -> bool:
    """Whether gcsfs will look for credentials itself: no token given, and no emulator
    (which needs none)."""
    return (options.get("token") is None and not options.get("endpoint_url")
            and not os.environ.get("STORAGE_EMULATOR_HOST"))


_found_credentials: dict[tuple[str | None, ...], bool] = {}  # per environment, this process


def credentials_may_exist() -> bool:
    """Whether any source of Google credentials is here: the key file variable, gcloud's
    application default credentials or login, gcsfs's token cache, or a metadata server
    (a GCE, GKE or Cloud Run host), which must answer within a second. Without this
    check, google-auth takes some 15 s probing for a metadata server that is not there.
    Asked once per process and environment."""
    env = tuple(os.environ.get(k) for k in ("GOOGLE_APPLICATION_CREDENTIALS",
                                            "CLOUDSDK_CONFIG", "HOME", "GCE_METADATA_HOST",
                                            "GCE_METADATA_IP"))
    if env not in _found_credentials:
        _found_credentials[env] = _look_for_credentials()
    return _found_credentials[env]


def _look_for_credentials() -> bool:
    if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
        return True
    home = os.path.expanduser("~")
    gcloud = os.environ.get("CLOUDSDK_CONFIG") or os.path.join(home, ".config", "gcloud")
    for path in (os.path.join(gcloud, "application_default_credentials.json"),
                 os.path.join(gcloud, "credentials.db"), os.path.join(home, ".gcs_tokens")):
        if os.path.exists(path):
            return True
    try:
        with open("/sys/class/dmi/id/product_name") as f:
            if "Google" in f.read():
                return True
    except OSError:
        pass
    host = os.environ.get("GCE_METADATA_HOST") or os.environ.get("GCE_METADATA_IP")
    conn = http.client.HTTPConnection(host or "169.254.169.254", timeout=1.0)
    try:
        conn.request("GET", "/computeMetadata/v1/", headers={"Metadata-Flavor": "Google"})
        return conn.getresponse().getheader("Metadata-Flavor") == "Google"
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def no_credentials(root: str) -> AccessDeniedError:
    return AccessDeniedError(
        f"no Google Cloud credentials were found for gs://{root}, so no request was sent "
        "(looked for GOOGLE_APPLICATION_CREDENTIALS, gcloud's application default "
        "credentials and a metadata server). Set GOOGLE_APPLICATION_CREDENTIALS to a key "
        "file, run `gcloud auth application-default login`, or pass the token storage "
        "option (token='anon' for public buckets)")


def mask_token(text: str, token: Any) -> str:
    """``text`` with every string in ``token`` (a raw token, or the fields of a
    credentials dict) masked, as is and URL-encoded."""
    values = [token] if isinstance(token, str) else (
        list(token.values()) if isinstance(token, dict) else [])
    methods = {"google_default", "cache", "cloud", "token", "anon", "browser"}
    return mask_secrets(text, (v for v in values if isinstance(v, str) and len(v) >= 8
                               and v not in methods))
