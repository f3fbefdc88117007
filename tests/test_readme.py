"""README.md's Python snippets and command lines run as written.

Every ```python block of the README is executed in order, in one namespace,
exactly as written, against S3 (moto on 127.0.0.1) reached only through the
standard environment (``AWS_ENDPOINT_URL``, ...) and a Hub-compatible server
reached through ``HF_ENDPOINT``/``HF_TOKEN``; then every command of the "Command
line" block runs in bash as written (``cloudckpt`` being this checkout's), in the
directory the snippets ran in, on what they left: nothing else prepares its inputs.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import re
import shlex
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import boto3
import pytest
import s3fs
import torch
from cloudckpt_testkit import HubServer
from helpers import HUB_TOKEN
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import cloudckpt
import cloudckpt.dcp as cdcp
from cloudckpt import CheckpointManager, hf

README = Path(__file__).parent.parent / "README.md"

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning",
                                        "ignore::FutureWarning", "ignore::UserWarning")


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def cli_block() -> str:
    section = README.read_text().split("## Command line", 1)[1]
    found = re.findall(r"^```bash\n(.*?)^```", section, flags=re.S | re.M)
    assert found, "README.md lost its command-line block"
    return found[0]


def s3_keys(s3_server, prefix: str) -> set[str]:
    """Keys below ``prefix`` in ``bucket``, seen by a client of its own (explicit
    endpoint): proof that the snippets wrote to the server the environment names."""
    client = boto3.client("s3", endpoint_url=s3_server.endpoint, region_name="us-east-1",
                          aws_access_key_id=s3_server.ACCESS_KEY,
                          aws_secret_access_key=s3_server.SECRET_KEY)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket="bucket", Prefix=prefix)
    return {o["Key"] for page in pages for o in page.get("Contents", [])}


@pytest.fixture(scope="module")
def readme(s3_server, gcs_server, tmp_path_factory):
    """The README's Python snippets, run once; both tests look at what they left.

    The environment is what a reader sets: the AWS variables, ``HF_ENDPOINT``
    and ``HF_TOKEN`` (huggingface_hub reads ``HF_ENDPOINT`` once, at import, so
    its constant is set too, as it would be in a process started with it).
    The Hub's cache and token files are isolated as ``conftest.hub_server`` does.
    """
    from huggingface_hub import constants

    tmp = tmp_path_factory.mktemp("readme")
    home = tmp / "hf_home"
    s3_server.reset()
    s3_server.create_bucket("bucket")
    gcs_server.reset()
    gcs_server.create_bucket("other")
    with pytest.MonkeyPatch.context() as mp, HubServer(token=HUB_TOKEN) as hub:
        for name, value in {**s3_server.env(), **gcs_server.env(),
                            "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": HUB_TOKEN,
                            "HF_HOME": str(home), "HF_HUB_CACHE": str(home / "hub"),
                            "HF_TOKEN_PATH": str(home / "token"), "HF_HUB_DISABLE_XET": "1",
                            "CLOUDCKPT_CACHE": str(tmp / "cache")}.items():
            mp.setenv(name, value)
        mp.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
        for name, value in {"ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_XET": True,
                            "HF_HUB_OFFLINE": False, "HF_HOME": str(home),
                            "HF_HUB_CACHE": str(home / "hub"),
                            "HF_TOKEN_PATH": str(home / "token")}.items():
            mp.setattr(constants, name, value)
        mp.chdir(tmp)
        # s3fs caches filesystems by their arguments, and each binds its endpoint when it
        # first connects: start from none, so every snippet reaches the server named above.
        s3fs.S3FileSystem.clear_instance_cache()
        snippets = blocks("python")
        ns: dict[str, Any] = {"__name__": "__readme__"}
        out = io.StringIO()
        with contextlib.redirect_stdout(out), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for code in snippets:
                exec(compile(code, str(README), "exec"), ns)
        after = {
            "run": cloudckpt.list_checkpoints("s3://bucket/run", include_uncommitted=True),
            "keys": s3_keys(s3_server, ""),
        }
        yield {"ns": ns, "out": out.getvalue(), "after": after, "hub": hub, "tmp": tmp,
               "snippets": snippets}
        s3fs.S3FileSystem.clear_instance_cache()


def test_python_snippets_run_and_do_what_they_say(readme, s3_server):
    ns, after, hub = readme["ns"], readme["after"], readme["hub"]
    assert len(readme["snippets"]) >= 5, "README.md lost Python snippets"

    # Every snippet wrote to the S3 server of the environment, and only committed data.
    keys = after["keys"]
    for uri in ("weights/step-0", "dcp/step-0", "dcp/step-1", "run/step-199", "run/step-299",
                "exports/llama-tiny"):
        assert f"{uri}/{cloudckpt.MANIFEST_NAME}" in keys, uri
    assert not any(k.startswith("run/step-99/") for k in keys)  # dropped by keep_last=2
    # The commands' inputs: stock torch's DCP files uploaded without a manifest (for
    # `adopt`), and the model's config.json beside the session (for `convert`).
    assert "torch-run/step-500/.metadata" in keys
    assert f"torch-run/step-500/{cloudckpt.MANIFEST_NAME}" not in keys
    assert (readme["tmp"] / "config.json").is_file()

    # CheckpointWriter: one committed checkpoint of the two objects, readable back.
    weights = cloudckpt.open_checkpoint("s3://bucket/weights/step-0")
    assert weights.step == 0
    assert {"model.pt", "optimizer.pt"} <= set(weights.files)
    assert cloudckpt.latest_checkpoint("s3://bucket/weights").uri == weights.uri
    saved = torch.load(io.BytesIO(weights.read("optimizer.pt")), weights_only=True)
    assert saved["param_groups"][0]["lr"] == 1e-3

    # DCP: both saves committed with their steps, each holding the untrained model that
    # the writer snippet saved (the async save is of the state the sync one loaded back).
    initial = torch.load(io.BytesIO(weights.read("model.pt")), weights_only=True)
    for step in (0, 1):
        assert cloudckpt.open_checkpoint(f"s3://bucket/dcp/step-{step}").step == step
        probe = {"model": {k: torch.full_like(v, float("nan")) for k, v in initial.items()}}
        cdcp.load(probe, f"s3://bucket/dcp/step-{step}")
        assert all(torch.equal(probe["model"][k], initial[k]) for k in initial), step

    # The manager: a fresh start, a resume from what the first run saved, retention.
    assert readme["out"].count("resumed after step 99") == 1, readme["out"]
    run = after["run"]
    assert [(c.name, c.step, c.committed) for c in run] == [("step-199", 199, True),
                                                            ("step-299", 299, True)]
    model, loader = ns["model"], ns["loader"]
    assert loader.pos == 300 and ns["scheduler"].last_epoch == 300

    # Restore step-299 into a perturbed copy: it equals the model the snippets trained.
    fresh = copy.deepcopy(model)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    assert not torch.equal(next(fresh.parameters()), next(model.parameters()))
    opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
    data = ns["Batches"](torch.zeros(512, 16), torch.zeros(512, 4), batch_size=8)
    msd, osd = get_state_dict(fresh, opt)
    state = {"model": msd, "optim": osd}
    info = CheckpointManager("s3://bucket/run").restore(
        state, extra={"sched": sched}, per_rank={"data": data}, rng=False)
    set_state_dict(fresh, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert info is not None and info.global_step == 299
    assert data.pos == 300 and sched.last_epoch == 300
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    ours, theirs = ns["optimizer"].state_dict()["state"], opt.state_dict()["state"]
    assert ours.keys() == theirs.keys() and ours
    assert all(torch.equal(ours[i]["exp_avg"], theirs[i]["exp_avg"]) for i in ours)

    # The HF export: committed, and what came back is the exported model.
    export = cloudckpt.open_checkpoint("s3://bucket/exports/llama-tiny")
    assert {"config.json", "model.safetensors"} <= set(export.files)
    tensors = hf.load_state_dict("s3://bucket/exports/llama-tiny")
    loaded = ns["llm"].state_dict()
    assert type(ns["llm"]).__name__ == "LlamaForCausalLM"
    assert tensors and all(torch.equal(tensors[k], loaded[k]) for k in tensors)

    # The Hub holds exactly the export's files (not its manifest), byte for byte.
    on_hub = {k: v for k, v in hub.files("my-org/llama-tiny").items() if k != ".gitattributes"}
    assert set(on_hub) == set(export.files) - {cloudckpt.MANIFEST_NAME}
    assert all(on_hub[k] == export.read(k) for k in on_hub)


def shell_commands(block: str) -> list[str]:
    """The block's commands as a shell reads them: continued lines joined, blank and
    comment-only lines dropped (comments after a command stay: the shell drops them)."""
    joined = re.sub(r"\\\n", " ", block)
    return [line for line in joined.splitlines() if line.strip()
            and not line.lstrip().startswith("#")]


def cloudckpt_on_path(tmp: Path) -> dict[str, str]:
    """An environment whose ``cloudckpt`` is this checkout's, run by this interpreter."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / "cloudckpt"
    exe.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m cloudckpt "$@"\n')
    exe.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "PYTHONWARNINGS": "ignore"}


def test_command_line_block_runs(readme, s3_server, gcs_server):
    """Every command of the block, run by bash exactly as written, in the directory
    the snippets ran in: the inputs they need come from the README alone."""
    tmp, hub = readme["tmp"], readme["hub"]
    commands = shell_commands(cli_block())
    env = cloudckpt_on_path(tmp)
    outputs = {}
    for command in commands:
        out = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", command], cwd=tmp,
                             env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"{command}: exit {out.returncode}\n" \
                                    f"{out.stdout}{out.stderr}"
        argv = shlex.split(command, comments=True)
        if argv[0] == "cloudckpt":
            outputs[argv[1]] = out.stdout
    assert {"ls", "info", "verify", "latest", "cp", "download", "rm", "adopt", "gc", "convert",
            "push"} <= set(outputs)

    listed = [line.split()[:3] for line in outputs["ls"].splitlines()[1:]]
    assert [row[0] for row in listed] == ["step-199", "step-299"]
    assert "step:      299" in outputs["info"]
    assert outputs["verify"].startswith("OK") and "CRC32C" in outputs["verify"]
    assert outputs["latest"].strip() == "s3://bucket/run/step-299"
    copied = cloudckpt.open_checkpoint("gs://other/run/step-299")
    copied.verify(deep=True)
    assert copied.step == 299
    src = cloudckpt.open_checkpoint("s3://bucket/run/step-299")
    assert copied.files == src.files
    local = cloudckpt.open_checkpoint(str(tmp / "step-299"))
    local.verify(deep=True)
    assert local.files == src.files
    assert [c.name for c in cloudckpt.list_checkpoints("s3://bucket/run",
                                                       include_uncommitted=True)] == ["step-299"]
    assert cloudckpt.open_checkpoint("s3://bucket/torch-run/step-500").files
    assert "nothing to collect" in outputs["gc"]
    mlp = hf.load_state_dict("s3://bucket/exports/mlp-299")
    trained = readme["ns"]["model"].state_dict()
    assert mlp.keys() == trained.keys()
    assert all(torch.equal(mlp[k], trained[k]) for k in mlp)
    on_hub = hub.files("my-org/mlp")
    assert on_hub["model.safetensors"] == cloudckpt.open_checkpoint(
        "s3://bucket/exports/mlp-299").read("model.safetensors")
