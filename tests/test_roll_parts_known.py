"""ROLL's one key and its count-free commit, without ROLL: a bucket ``output_dir`` given
to ROLL's ``file_system`` type builds cloudckpt's uploader (ROLL's timestamp taken off),
and the rule that says a checkpoint's parts are all in."""

from __future__ import annotations

import pytest

from cloudckpt.integrations.roll.bucketkey import as_written, file_system_or_bucket
from cloudckpt.integrations.roll.membership import declare, missing
from cloudckpt.integrations.roll.uploader import S3Uploader


class LocalUploader:
    """Stands for ROLL's FileSystemUploader: what a local output_dir still builds."""

    def __init__(self, output_dir, *args, **kwargs):
        self.output_dir = output_dir


def test_a_bucket_output_dir_of_the_file_system_type_is_cloudckpts_uploader(s3, monkeypatch):
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    build = file_system_or_bucket(LocalUploader)
    up = build(output_dir=f"{s3.root}/20261206-233009", async_upload=False)
    assert isinstance(up, S3Uploader) and up.output_dir == s3.root
    assert isinstance(build(output_dir="/data/ckpts"), LocalUploader)
    # Wrapping twice wraps ROLL's class, not the wrapper.
    assert isinstance(file_system_or_bucket(build)(output_dir="x"), LocalUploader)


@pytest.mark.parametrize("uri, written", [
    ("s3://b/run/exp/20261206-233009", "s3://b/run/exp"),
    ("s3://b/run/exp", "s3://b/run/exp"),
    ("s3://b/run/2026-12-06", "s3://b/run/2026-12-06"),
])
def test_only_rolls_own_timestamp_is_taken_off(uri, written):
    assert as_written(uri) == written


def marker(part, group, rank, world):
    return {"part": part, "group": group, "rank": rank, "world": world, "files": {}}


def parts(*markers):
    return {f"_cloudckpt_parts/{m['part']}.json": m for m in markers}


PIPELINE = marker("pipeline", "pipeline", 0, 1)
A0, A1 = marker("actor_train-0", "actor_train", 0, 2), marker("actor_train-1", "actor_train", 1, 2)


def test_all_declared_ranks_and_the_pipeline_make_a_checkpoint():
    assert missing(parts(PIPELINE, A0, A1), {"pipeline", "actor_train-0"}) == []


@pytest.mark.parametrize("present, intents, gap", [
    ((A0, A1), set(), "the pipeline's part"),
    ((PIPELINE, A0), set(), "1 of 2 ranks of actor_train (actor_train-1)"),
    ((PIPELINE, A0, A1), {"critic-0"}, "part 'critic-0' (announced, still uploading)"),
    ((PIPELINE, A0, marker("actor_train-1", "actor_train", 1, 4)), set(),
     "actor_train: its parts disagree on its size ([2, 4])"),
])
def test_a_part_short_is_named(present, intents, gap):
    assert gap in "; ".join(missing(parts(*present), intents))


def test_a_part_outside_a_process_group_is_a_set_of_one():
    assert declare("pipeline") == {"group": "pipeline", "rank": 0, "world": 1}
    assert declare("host-1234-ab") == {"group": "host-1234-ab", "rank": 0, "world": 1}


def test_a_cluster_of_an_earlier_checkpoint_must_be_there_again():
    gaps = missing(parts(PIPELINE, A0, A1), set(), known={"actor_train", "critic", "pipeline"})
    assert gaps == ["every part of critic (in an earlier checkpoint of this run)"]
