"""Start LocalStack with its default web server (twisted) bound to one interface, and
its S3 files in a directory of the instance's own.

- LocalStack's twisted server ignores the host of ``GATEWAY_LISTEN`` and listens on every
  interface: twisted's IPv4 endpoint is wrapped to bind ``$CLOUDCKPT_BIND_HOST``.
- Its S3 provider keeps objects' files below one fixed path for every instance on the
  machine, where one instance deleting a bucket deletes the files of another's bucket of
  that name: it is moved to ``$CLOUDCKPT_S3_DIR`` before the provider starts.

Run by LocalStack's own Python (its virtualenv), not the project's, so it imports nothing
of the test kit:

    <localstack python> localstack_launch.py
"""

from __future__ import annotations

import os
import runpy

import localstack.services.s3.provider as s3_provider
from twisted.internet import endpoints

_host = os.environ["CLOUDCKPT_BIND_HOST"]
_endpoint = endpoints.TCP4ServerEndpoint


def _bound(reactor, port, backlog=50, interface=""):  # noqa: ANN001, ANN202
    return _endpoint(reactor, port, backlog, interface or _host)


endpoints.TCP4ServerEndpoint = _bound  # type: ignore[misc]
s3_provider.DEFAULT_S3_TMP_DIR = os.environ["CLOUDCKPT_S3_DIR"]
runpy.run_module("localstack.runtime.main", run_name="__main__")
