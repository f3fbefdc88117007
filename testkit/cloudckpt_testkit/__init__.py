"""Test helpers: real local S3/GCS servers, a Hub-compatible server, a fault proxy.

Importing this package sets ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` (if
unset) so that gcsfs, when imported afterwards, talks to emulators without
stalling; see :mod:`cloudckpt_testkit.servers`.
"""

from cloudckpt_testkit.faultproxy import FaultPlan, FaultProxy
from cloudckpt_testkit.hubserver import HubServer
from cloudckpt_testkit.servers import AzuriteServer, FakeGcsServer, LocalStackServer, MotoServer

__all__ = ["AzuriteServer", "FakeGcsServer", "FaultPlan", "FaultProxy", "HubServer",
           "LocalStackServer", "MotoServer"]
