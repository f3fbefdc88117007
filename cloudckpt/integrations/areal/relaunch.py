"""AReaL's launcher behaviour: relaunch a failed training job, up to N times."""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from cloudckpt.errors import CloudCkptError, ConfigError

log = logging.getLogger(__name__)


def run_with_retries(train: Callable[[], Any] | Sequence[str], retries: int = 3,
                     delay_s: float = 10.0, *, env: Mapping[str, str] | None = None,
                     **run_kwargs: Any) -> Any:
    """Run a training job and relaunch it after a failure, up to ``retries`` times,
    ``delay_s`` apart, like AReaL's launcher (each relaunch resumes through
    :meth:`RecoverHandler.load`).

    ``train`` is a function (a failure is an exception; its result is returned) or a
    command line (a failure is a non-zero exit, a SIGKILL included; the last
    ``CompletedProcess`` is returned; ``run_kwargs`` go to :func:`subprocess.run`, e.g.
    ``stdout=``). Relaunches see ``AREAL_RECOVER_RUN=1``.
    """
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ConfigError(f"retries must be an integer >= 0, got {retries!r}")
    attempt = 0
    while True:
        if attempt:
            os.environ["AREAL_RECOVER_RUN"] = "1"
        try:
            if callable(train):
                return train()
            run_env = {**os.environ, **dict(env or {})}
            if attempt:
                run_env["AREAL_RECOVER_RUN"] = "1"
            proc = subprocess.run(list(train), env=run_env, check=False, **run_kwargs)
            if proc.returncode == 0:
                return proc
            error: BaseException = CloudCkptError(
                f"training exited with status {proc.returncode}")
        except Exception as exc:  # noqa: BLE001 - any training failure is retried
            error = exc
        if attempt >= retries:
            log.error("training failed %d time(s); giving up: %s", attempt + 1, error)
            raise error
        attempt += 1
        log.warning("training failed (%s); relaunch %d of %d in %.0f s", error, attempt,
                    retries, delay_s)
        time.sleep(delay_s)
