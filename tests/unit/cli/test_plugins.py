"""``plugins=[...]``: a user's module imported before train-ppo's config is validated, so the
estimator it registers is a name the command line takes (a dotted name from the working directory,
or a .py path; also from the YAML file, and on every torchrun rank); a plugin that fails to import
is one line naming it, exit 2. The docs' worked example trains from the command line in
tests/integration/test_critic_free_cli.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from openaligner.cli.main import main
from openaligner.trainer.estimators import ESTIMATORS

YAML = Path(__file__).resolve().parents[3] / "configs" / "train_ppo.yaml"
SRC = Path(__file__).resolve().parents[3] / "src"
GROUPS = ["trainer.n_samples_per_prompt=4"]

PLUGIN = """
import os
from pathlib import Path

from openaligner.algorithms import broadcast_to_tokens
from openaligner.trainer.estimators import Estimate, register_estimator

if os.environ.get("PLUGIN_MARKS"):  # which processes imported this module
    Path(os.environ["PLUGIN_MARKS"], "rank" + os.environ.get("RANK", "-")).touch()


@register_estimator("{name}", needs_groups=True)
def estimate(x):
    groups = x.scores.reshape(-1, x.group_size)
    per_sample = (groups - groups.mean(-1, keepdim=True)).reshape(-1)
    return Estimate(broadcast_to_tokens(per_sample, x.mask), x.scores)
"""


@pytest.fixture
def plugin(tmp_path):
    """Writes a plugin module ``name`` registering the estimator ``name`` into ``tmp_path``;
    unregisters and unloads what the test imported."""
    made: list[str] = []

    def write(name: str) -> Path:
        path = tmp_path / f"{name}.py"
        path.write_text(PLUGIN.format(name=name))
        made.append(name)
        return path

    yield write
    for name in made:
        ESTIMATORS.pop(name, None)
        sys.modules.pop(name, None)


def test_a_plugin_file_registers_an_estimator_the_command_line_takes(plugin, capsys):
    path = plugin("plugin_mean_file")
    args = ["train-ppo", str(YAML), "trainer.advantage_estimator=plugin_mean_file", *GROUPS]
    assert main([*args, "--print-config"]) == 2  # unknown until its module is imported
    assert "must be one of gae" in capsys.readouterr().err
    assert main([*args, f"plugins=[{path}]", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert f"plugins:\n- {path}\n" in out and "advantage_estimator: plugin_mean_file" in out
    # a second run in this process imports nothing again (a registered name twice is refused)
    assert main([*args, f"plugins=[{path}]", "--print-config"]) == 0


def test_a_module_name_is_found_from_the_working_directory_and_read_from_the_yaml(
    plugin, tmp_path, monkeypatch, capsys
):
    plugin("plugin_mean_module")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    config = tmp_path / "run.yaml"
    config.write_text(f"{YAML.read_text()}\n".replace("plugins: []", "plugins: [plugin_mean_module]"))
    args = ["train-ppo", str(config), "trainer.advantage_estimator=plugin_mean_module", *GROUPS]
    assert main([*args, "--print-config"]) == 0, capsys.readouterr().err
    assert "plugin_mean_module" in ESTIMATORS
    # an override replaces the file's list
    assert main(["train-ppo", str(config), "plugins=[]", "--print-config"]) == 0
    assert "plugins: []" in capsys.readouterr().out


def test_a_plugin_that_fails_to_import_is_one_line_naming_it(tmp_path, capsys):
    broken = tmp_path / "broken_plugin.py"
    broken.write_text('raise RuntimeError("no GPU here\\nsecond line")\n')
    for name, why in (
        (str(broken), "RuntimeError: no GPU here"),
        ("no_such_plugin_module", "ModuleNotFoundError: No module named 'no_such_plugin_module'"),
        (str(tmp_path / "missing.py"), "FileNotFoundError"),
    ):
        assert main(["train-ppo", str(YAML), f"plugins=[{name}]", "--print-config"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"openaligner train-ppo: plugins: cannot import {name}: {why}"), err
        assert len(err.splitlines()) == 1
    assert "broken_plugin" not in sys.modules
    assert main(["train-ppo", str(YAML), "plugins=my_estimators", "--print-config"]) == 2
    assert "plugins must be a list of module names or .py paths" in capsys.readouterr().err


def test_a_command_without_plugins_refuses_the_key(capsys):
    assert main(["serve-reward", "model.tiny=gpt2", "plugins=[x]", "--print-config"]) == 2
    assert "unknown key 'plugins'" in capsys.readouterr().err


@pytest.mark.slow
def test_every_torchrun_rank_imports_the_plugins(plugin, tmp_path):
    path = plugin("plugin_mean_ranks")
    marks = tmp_path / "marks"
    marks.mkdir()
    env = {**os.environ, "PYTHONPATH": str(SRC), "PLUGIN_MARKS": str(marks), "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    args = [f"plugins=[{path}]", "trainer.advantage_estimator=plugin_mean_ranks", *GROUPS, "--print-config"]
    done = subprocess.run(
        [*torchrun, "-m", "openaligner", "train-ppo", str(YAML), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.name for p in marks.iterdir()) == ["rank0", "rank1"]
