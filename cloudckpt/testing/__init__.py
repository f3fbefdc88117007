"""Test helpers: real local S3/GCS servers, a Hub-compatible server, a fault proxy.

Importing this package sets ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` (if
unset) so that gcsfs, when imported afterwards, talks to emulators without
stalling; see :mod:`cloudckpt.testing.servers`.
"""

from cloudckpt.testing.faultproxy import FaultPlan, FaultProxy
from cloudckpt.testing.hubserver import HubServer
from cloudckpt.testing.servers import FakeGcsServer, MotoServer

__all__ = ["FakeGcsServer", "FaultPlan", "FaultProxy", "HubServer", "MotoServer"]
