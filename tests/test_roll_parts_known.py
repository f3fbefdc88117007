"""ROLL's one key and its count-free commit, without ROLL: a bucket ``output_dir`` given
to ROLL's ``file_system`` type builds cloudckpt's uploader (ROLL's timestamp taken off),
and the rule that says a checkpoint's parts are all in."""

from __future__ import annotations

import pytest

from cloudckpt.integrations.roll.bucketkey import as_written, file_system_or_bucket
from cloudckpt.integrations.roll.membership import declare, missing
from cloudckpt.integrations.roll.resume import recorded_clusters
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
    # ROLL uploads the pipeline's part while its workers' async DCP saves still run.
    ((PIPELINE,), set(), "the pipeline's part alone is no checkpoint"),
])
def test_a_part_short_is_named(present, intents, gap):
    assert gap in "; ".join(missing(parts(*present), intents))


def test_a_part_outside_a_process_group_is_a_set_of_one():
    assert declare("pipeline", {}) == {"group": "pipeline", "rank": 0, "world": 1}
    assert declare("host-1234-ab", {}) == {"group": "host-1234-ab", "rank": 0, "world": 1}


def test_a_rolls_worker_declares_its_cluster_from_what_roll_set_in_it():
    """ROLL names a GPU worker's directory ``actor_train-3-G3`` and starts it with
    CLUSTER_NAME, RANK and WORLD_SIZE."""
    env = {"CLUSTER_NAME": "actor_train", "RANK": "3", "WORLD_SIZE": "8"}
    assert declare("actor_train-3-G3", env) == {"group": "actor_train", "rank": 3, "world": 8}
    # The driver's pipeline part, in a process ROLL started with no cluster of its own.
    assert declare("pipeline", env)["group"] == "pipeline"


def test_a_cluster_of_an_earlier_checkpoint_must_be_there_again():
    gaps = missing(parts(PIPELINE, A0, A1), set(), known={"actor_train", "critic", "pipeline"})
    assert len(gaps) == 1 and gaps[0].startswith("every part of critic (the newest committed "
                                                 "checkpoint has it;")


def test_the_clusters_a_commit_records_bind_every_later_attempt(s3, monkeypatch, tmp_path):
    """What the newest committed checkpoint was made of is read from the bucket by a
    new uploader (a relaunch), not remembered by the process that committed it."""
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)

    def upload(uploader, ckpt_id, part, cluster=None, rank=0, world=1):
        for key, value in (("CLUSTER_NAME", cluster), ("RANK", str(rank)),
                           ("WORLD_SIZE", str(world))):
            if cluster is None:
                monkeypatch.delenv(key, raising=False)
            else:
                monkeypatch.setenv(key, value)
        src = tmp_path / part / ckpt_id
        src.mkdir(parents=True)
        name = ("pipeline/worker_state_pipeline.json" if part == "pipeline"  # ROLL's resume
                else f"{part}.json")                                   # reads it first
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text("{}")
        uploader.upload(ckpt_id, str(src))

    first = S3Uploader(output_dir=s3.root, async_upload=False)
    upload(first, "checkpoint-2", "pipeline")
    assert not first.store.child("checkpoint-2").exists("cloudckpt-manifest.json")
    for rank in range(2):
        upload(first, "checkpoint-2", f"actor_train-{rank}-G{rank}", "actor_train", rank, 2)
    assert first.store.child("checkpoint-2").exists("cloudckpt-manifest.json"), \
        first._try_commit("checkpoint-2", None)
    assert recorded_clusters(first.store) == {"actor_train"}

    relaunch = S3Uploader(output_dir=s3.root, async_upload=False, parts_timeout=0.5)
    upload(relaunch, "checkpoint-3", "critic-0", "critic", 0, 1)
    upload(relaunch, "checkpoint-3", "pipeline")
    assert not relaunch.store.child("checkpoint-3").exists("cloudckpt-manifest.json")
