"""Every integration checks the bucket when it is set up, before training starts:
a misspelt bucket fails there, naming it, not at the first save (moto over HTTP)."""

from __future__ import annotations

import pytest

from cloudckpt import BucketNotFoundError
from cloudckpt.integrations import rlinf
from cloudckpt.integrations.roll import S3Uploader


def test_rlinf_checkpointer_refuses_a_missing_bucket_at_construction(s3):
    with pytest.raises(BucketNotFoundError, match="cloudckpt-tset"):
        rlinf.RLinfCheckpointer(rlinf.RunnerConfig("s3://cloudckpt-tset/out", "exp",
                                                   save_interval=10, max_steps=100),
                                storage_options=s3.options)


def test_roll_uploader_refuses_a_missing_bucket_at_construction(s3):
    with pytest.raises(BucketNotFoundError, match="cloudckpt-tset"):
        S3Uploader(output_dir="s3://cloudckpt-tset/roll", storage_options=s3.options)
