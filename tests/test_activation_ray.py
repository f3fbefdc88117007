"""What ``ray.init`` carries into a job's workers under activation
(cloudckpt.activation.ray): the user's runtime_env merged, never dropped, and a
contradiction refused. The whole path, on a Ray cluster started on its own, is
tests/compat/test_ray_separate_cluster.py."""

from __future__ import annotations

import types

import pytest

from cloudckpt.activation import ray as carry
from cloudckpt.errors import ConfigError


def users_hook() -> None:
    pass


def test_carried_names_the_integrations_and_the_attempt_only():
    env = carry.carried("verl", allow_untested=True, environ={
        "CLOUDCKPT_ATTEMPT_STARTED": "12.5", "CLOUDCKPT_RUN_ID": "r", "HOME": "/h",
        "CLOUDCKPT_RUN_ATTEMPT": ""})
    assert env == {"CLOUDCKPT_INTEGRATIONS": "verl", "CLOUDCKPT_ALLOW_UNTESTED": "1",
                   "CLOUDCKPT_RUN_ID": "r", "CLOUDCKPT_ATTEMPT_STARTED": "12.5"}


def test_an_empty_runtime_env_gets_the_variables_and_the_hook_by_module_path():
    got = carry.merged(None, {"CLOUDCKPT_INTEGRATIONS": "auto"})
    assert got == {"env_vars": {"CLOUDCKPT_INTEGRATIONS": "auto"},
                   "worker_process_setup_hook": "cloudckpt.activation.ray.setup_worker"}


def test_the_users_runtime_env_is_kept_and_their_hook_runs_after_ours(monkeypatch):
    theirs = {"env_vars": {"A": "1", "CLOUDCKPT_INTEGRATIONS": "auto"}, "pip": ["x"],
              "worker_process_setup_hook": users_hook}
    got = carry.merged(theirs, {"CLOUDCKPT_INTEGRATIONS": "auto", "CLOUDCKPT_RUN_ID": "r"})
    assert theirs["env_vars"] == {"A": "1", "CLOUDCKPT_INTEGRATIONS": "auto"}  # untouched
    assert got["pip"] == ["x"]
    assert got["env_vars"] == {"A": "1", "CLOUDCKPT_INTEGRATIONS": "auto",
                               "CLOUDCKPT_RUN_ID": "r"}
    hook = got["worker_process_setup_hook"]
    assert hook.__name__ == "cloudckpt_then_users_hook"
    order: list[str] = []
    monkeypatch.setattr(carry, "setup_worker", lambda: order.append("cloudckpt"))
    hook.theirs = lambda: order.append("theirs")
    hook()
    assert order == ["cloudckpt", "theirs"]


def test_a_users_hook_named_by_module_path_runs_after_ours(monkeypatch):
    ran: list[str] = []
    monkeypatch.setattr(carry, "setup_worker", lambda: ran.append("cloudckpt"))
    monkeypatch.setattr("os.getcwd", lambda: ran.append("theirs") or "/")
    got = carry.merged({"worker_process_setup_hook": "os.getcwd"}, {})
    got["worker_process_setup_hook"]()
    assert ran == ["cloudckpt", "theirs"]


def test_a_contradicting_variable_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"CLOUDCKPT_INTEGRATIONS='roll' \(activation: "
                       r"'auto'\).*remove them from the runtime_env"):
        carry.merged({"env_vars": {"CLOUDCKPT_INTEGRATIONS": "roll"}},
                     {"CLOUDCKPT_INTEGRATIONS": "auto"})


def test_rays_own_exported_hook_is_refused():
    with pytest.raises(ConfigError, match="worker_process_setup_hook"):
        carry.merged({"env_vars": {"__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR": "k"}}, {})


def test_ray_init_carries_it_once_and_says_so_once(monkeypatch, caplog):
    calls: list[dict] = []
    fake = types.ModuleType("ray")
    fake.init = lambda *a, **kw: calls.append(kw)  # type: ignore[attr-defined]
    monkeypatch.setattr(carry, "_said", False)
    monkeypatch.setenv("CLOUDCKPT_ATTEMPT_STARTED", "5.0")
    carry.carry_into(fake, "verl", allow_untested=False)
    carry.carry_into(fake, "verl", allow_untested=False)  # wrapped once
    job = types.SimpleNamespace(runtime_env={"env_vars": {"J": "1"}})
    with caplog.at_level("INFO", "cloudckpt.activation"):
        fake.init(address="auto", job_config=job)
        fake.init(runtime_env={"env_vars": {"K": "2"}})
    assert calls[0]["runtime_env"]["env_vars"] == {
        "J": "1", "CLOUDCKPT_INTEGRATIONS": "verl", "CLOUDCKPT_ATTEMPT_STARTED": "5.0"}
    assert calls[0]["address"] == "auto" and calls[0]["job_config"] is job
    assert calls[1]["runtime_env"]["env_vars"]["K"] == "2"
    lines = [r.getMessage() for r in caplog.records if "carries activation" in r.getMessage()]
    assert len(lines) == 1 and "CLOUDCKPT_INTEGRATIONS=verl" in lines[0]
