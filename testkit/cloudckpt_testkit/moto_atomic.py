"""moto's S3 server with conditional writes made atomic, as S3's are.

moto checks ``If-None-Match: *`` and ``If-Match`` and only later stores the object,
so two racing create-only writes can both succeed when the machine is busy: a race
real S3 never loses. Requests carrying a condition are serialised here (the check
and the write happen under one lock); every other request runs as moto runs it.

    python -m cloudckpt_testkit.moto_atomic -H 127.0.0.1 -p PORT
"""

from __future__ import annotations

import functools
import threading
from typing import Any

_CONDITIONS = ("If-None-Match", "If-Match")


def _atomic(method: Any, lock: threading.Lock) -> Any:
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if any(self.headers.get(h) for h in _CONDITIONS):
            with lock:
                return method(self, *args, **kwargs)
        return method(self, *args, **kwargs)

    return wrapper


def patch() -> None:
    """Serialise moto's conditional PUTs and multipart completions."""
    from moto.s3.responses import S3Response

    lock = threading.Lock()
    for name in ("_key_response_put", "_key_response_post"):
        setattr(S3Response, name, _atomic(getattr(S3Response, name), lock))


def main() -> None:
    from moto.server import main as moto_main

    patch()
    moto_main()


if __name__ == "__main__":
    main()
