"""A store that loses the bucket mid-save (a server restarted empty): the save fails
with the real cause, the bucket being gone, promptly; not with what the serialiser
made of a failed write (moto over HTTP, reset mid-upload)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from cloudckpt_testkit import FaultProxy

import cloudckpt.dcp as cdcp
from cloudckpt import BucketNotFoundError, CheckpointManager, StepInfo


@pytest.mark.parametrize("how", ["dcp", "manager"])
def test_bucket_gone_mid_save_is_bucket_not_found(s3, s3_server, how):
    once = threading.Lock()

    def on_request(method: str, target: str) -> None:
        if method in ("PUT", "POST") and ".distcp" in target and once.acquire(blocking=False):
            s3_server.reset()  # the server forgets every bucket, as a restart would

    state = {f"t{i}": torch.full((256, 1024), float(i)) for i in range(8)}
    with FaultProxy(s3_server.endpoint, on_request=on_request) as proxy:
        options = {**s3.options, "endpoint_url": proxy.endpoint}
        start = time.monotonic()
        with pytest.raises(BucketNotFoundError, match="cloudckpt-test") as err:
            if how == "dcp":
                cdcp.save(state, s3.uri("ckpt"), storage_options=options)
            else:
                CheckpointManager(s3.root, storage_options=options).save(StepInfo(), state,
                                                                          force=True)
        took = time.monotonic() - start
    assert "unexpected pos" not in str(err.value)
    assert took < 10, f"the save took {took:.1f} s to fail"


def test_a_failed_write_inside_torch_save_raises_its_own_error(s3, s3_server):
    from cloudckpt import CheckpointWriter

    writer = CheckpointWriter(s3.uri("ckpt"), storage_options={**s3.options,
                                                                "part_size": 256 * 1024})
    writer.put("small.bin", b"claims the prefix first")
    s3_server.reset()  # then the bucket goes away
    with pytest.raises(BucketNotFoundError, match="does not exist"):
        with writer.open("big.pt") as f:  # streamed: parts go up while torch.save writes
            torch.save(torch.randn(1024, 1024), f)

