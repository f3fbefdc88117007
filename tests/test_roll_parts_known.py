"""ROLL's one key and its count-free commit, without ROLL: a bucket ``output_dir`` given
to ROLL's ``file_system`` type builds cloudckpt's uploader (ROLL's timestamp taken off),
and the rule that says a checkpoint's parts are all in."""

from __future__ import annotations

import json

import pytest

from cloudckpt import open_checkpoint
from cloudckpt.errors import IncompleteCheckpointError
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
    # Reported by the relaunch's wait (and so not left for its exit, past the server's).
    with pytest.raises(IncompleteCheckpointError, match="checkpoint-3 never committed"):
        relaunch.wait()


def declaring(clusters):
    return {**PIPELINE, "clusters": clusters}


def test_every_checkpoint_cluster_the_pipeline_names_must_be_in():
    """The first checkpoint of an output directory (nothing known yet): the pipeline's
    part names the critic, none of whose ranks has uploaded; without that declaration
    the same parts make a whole checkpoint."""
    C0 = marker("critic-0", "critic", 0, 1)
    named = declaring({"actor_train": 2, "critic": 1})
    assert missing(parts(PIPELINE, A0, A1), set()) == []
    gaps = missing(parts(named, A0, A1), set())
    assert gaps == ["every part of critic (1 rank: a checkpoint cluster of ROLL's pipeline, "
                    "none of whose ranks has uploaded yet)"]
    assert missing(parts(named, A0, A1, C0), set()) == []
    assert "1 of 2 ranks of actor_train (actor_train-1)" in missing(parts(named, A0, C0), set())
    # A cluster whose ranks say another size than the pipeline's: never whole.
    assert missing(parts(declaring({"actor_train": 4}), A0, A1), set()) == \
        ["actor_train: its parts disagree on its size ([2, 4])"]


def test_the_pipeline_part_declares_the_clusters_it_is_given():
    clusters = {"actor_train": 2, "critic": 1}
    assert declare("pipeline", {}, clusters=clusters) == \
        {"group": "pipeline", "rank": 0, "world": 1, "clusters": clusters}
    assert "clusters" not in declare("pipeline", {}, clusters=None)


class Cluster:
    """ROLL's Cluster, as the pipeline's part reads it."""

    def __init__(self, cluster_name, world_size):
        self.cluster_name, self.world_size = cluster_name, world_size


class Manager:
    """ROLL's CheckpointManager: builds the uploader from checkpoint_config."""

    def __init__(self, **checkpoint_config):
        self.uploader = S3Uploader(**checkpoint_config)


class Pipeline:
    """BasePipeline's shape: its manager built in __init__, its checkpoint clusters."""

    checkpoint_clusters: list = []

    def __init__(self, **checkpoint_config):
        self.checkpoint_manager = Manager(**checkpoint_config)

    def set_checkpoint_clusters(self, *clusters):
        self.checkpoint_clusters.extend(clusters)

    def do_checkpoint(self, global_step):
        raise NotImplementedError


def test_the_pipelines_part_names_its_checkpoint_clusters(s3, monkeypatch, tmp_path):
    """The uploader ROLL's pipeline builds finds the pipeline; its part then names the
    pipeline's checkpoint clusters as they are at the upload, and the first checkpoint of
    the output directory waits for the critic. A manager built by hand names none."""
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(Pipeline, "checkpoint_clusters", [])
    pipeline = Pipeline(output_dir=s3.root, async_upload=False, parts_timeout=0.5)
    pipeline.set_checkpoint_clusters(Cluster("actor_train", 2), Cluster("critic", 1))
    alone = Manager(output_dir=s3.root, async_upload=False, parts_timeout=0.5).uploader
    assert alone._pipeline is None

    def upload(uploader, part, cluster=None, rank=0, world=1):
        env = {"CLUSTER_NAME": cluster, "RANK": str(rank), "WORLD_SIZE": str(world)}
        for key, value in env.items():
            monkeypatch.setenv(key, value) if cluster else monkeypatch.delenv(key, False)
        src = tmp_path / part / "checkpoint-1"
        name = "pipeline/worker_state_pipeline.json" if part == "pipeline" else f"{part}.json"
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text("{}")
        uploader.upload("checkpoint-1", str(src))

    ckpt = pipeline.checkpoint_manager.uploader.store.child("checkpoint-1")
    for rank in range(2):
        upload(alone, f"actor_train-{rank}", "actor_train", rank, 2)
    upload(pipeline.checkpoint_manager.uploader, "pipeline")
    assert json.loads(ckpt.get("_cloudckpt_parts/pipeline.json"))["clusters"] == \
        {"actor_train": 2, "critic": 1}
    assert not ckpt.exists("cloudckpt-manifest.json")
    upload(alone, "critic-0", "critic", 0, 1)
    assert open_checkpoint(ckpt.uri, s3.options).metadata["parts"] == \
        ["actor_train-0", "actor_train-1", "critic-0", "pipeline"]
    for uploader in (alone, pipeline.checkpoint_manager.uploader):
        uploader.wait()  # nothing left open for the exit's check
