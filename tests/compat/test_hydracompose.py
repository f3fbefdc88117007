"""``cloudckpt.util.hydracompose``, the composition every framework's doctor reads a
launch with: hydra's own result, its global state left as a doctor found no use for,
and each failure a ConfigError naming the launch, the config and the fix."""

from __future__ import annotations

import pytest
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from cloudckpt.errors import ConfigError
from cloudckpt.util.hydracompose import compose


@pytest.fixture
def config_dir(tmp_path):
    (tmp_path / "base.yaml").write_text("out: ./ckpts\nsteps: 3\n")
    (tmp_path / "run.yaml").write_text("defaults:\n  - base\nname: job\n")
    return tmp_path


def test_composes_defaults_and_overrides_with_hydras_node_on_request(config_dir):
    cfg = compose(config_dir, "run", ["steps=5"], needed_by="reading a toy launch",
                  version_base=None)
    assert (cfg.out, cfg.steps, cfg.name) == ("./ckpts", 5, "job")
    assert "hydra" not in cfg
    full = compose(config_dir, "run", needed_by="reading a toy launch", version_base=None,
                   job_name="train", return_hydra_config=True)
    assert full.hydra.job.name == "train"


def test_a_hydra_left_initialized_is_cleared_first(config_dir, tmp_path_factory):
    other = tmp_path_factory.mktemp("other")
    with initialize_config_dir(config_dir=str(other), version_base=None):
        assert GlobalHydra.instance().is_initialized()  # by another reader
        assert compose(config_dir, "base", needed_by="x", version_base=None).steps == 3


@pytest.mark.parametrize("name, overrides, says", [
    ("absent", [], "absent in"),
    ("run", ["nokey=1"], "with overrides ['nokey=1']"),
])
def test_a_failure_names_the_launch_the_config_and_the_fix(config_dir, name, overrides,
                                                          says):
    with pytest.raises(ConfigError) as err:
        compose(config_dir, name, overrides, needed_by="reading a toy launch",
                version_base=None)
    text = str(err.value)
    assert text.startswith("reading a toy launch: hydra could not compose the config ")
    assert says in text and str(config_dir) in text and "fix the file" in text
