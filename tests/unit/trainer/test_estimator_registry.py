"""The advantage-estimator registry: the worked example of docs/algorithms.md ("Add your own
estimator") runs as written and trains a step; names are checked; the config lists the registered
names; the trainer asks the registration whether there is a critic."""

import re
from pathlib import Path

import pytest
from ppo_fakes import make_trainer, ppo_cfg
from test_critic_free_trainer import RewardOnly

from openaligner.config import ConfigError, load_config
from openaligner.trainer.estimators import ESTIMATORS, get_estimator, register_estimator
from openaligner.trainer.ppo_checkpoint import ACTOR_FILES
from openaligner.trainer.ppo_config import PPOConfig

DOC = Path(__file__).parents[3] / "docs" / "algorithms.md"


def doc_example_blocks() -> list[str]:
    """The ```python blocks of the "Add your own estimator" section, in order."""
    text = DOC.read_text()
    section = text[text.index("## Add your own estimator") :]
    section = section[: section.index("\n## ", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 3, "the section's example is three python blocks"
    return blocks


@pytest.fixture
def group_mean():
    """The doc's estimator registered for one test, and unregistered after it."""
    ESTIMATORS.pop("group_mean", None)
    namespace: dict = {}
    yield namespace
    ESTIMATORS.pop("group_mean", None)


def test_the_docs_add_your_own_estimator_example_runs_and_trains(tmp_path, group_mean):
    for block in doc_example_blocks():  # each block asserts its own worked example
        exec(compile(block, str(DOC), "exec"), group_mean)
    estimator = get_estimator("group_mean")
    assert (estimator.needs_critic, estimator.needs_groups) == (False, True)
    # its refusal names the key and the fix, as the built-in refusals do
    with pytest.raises(ConfigError, match=r"trainer\.kl_in: group_mean ignores a KL in the reward"):
        load_config(PPOConfig, None, ["advantage_estimator=group_mean", "kl_in=reward"])
    # a registered estimator trains in the loop: groups of 4, no critic called, a checkpoint
    client = RewardOnly()
    cfg = ppo_cfg(advantage_estimator="group_mean", num_rollout_samples=4, max_steps=1)
    (m,) = make_trainer(tmp_path, cfg, client=client).fit()
    assert m["rollout/rollout_size"] == 16 and m["policy/optim_step"] == 2
    assert m["rollout/advantages_mean"] == pytest.approx(0.0, abs=1e-6)  # group-mean baselines
    assert not any(k.startswith("value/") for k in m)
    assert ACTOR_FILES.read_state(tmp_path / "ckpt" / "step_1")["critic_step"] is None


def test_the_unknown_name_refusal_lists_every_registered_estimator(group_mean):
    with pytest.raises(
        ConfigError, match="must be one of gae, reinforce, rloo, grpo, dr_grpo, reinforce_pp,"
    ):
        load_config(PPOConfig, None, ["advantage_estimator=ppo"])
    exec(compile(doc_example_blocks()[0], str(DOC), "exec"), group_mean)
    with pytest.raises(ConfigError, match=r"reinforce_pp, group_mean, got 'ppo'"):
        load_config(PPOConfig, None, ["advantage_estimator=ppo"])
    with pytest.raises(ValueError, match="registered: gae, reinforce, rloo"):
        get_estimator("ppo")


def test_names_are_lower_case_identifiers_registered_once():
    with pytest.raises(ValueError, match="already registered"):
        register_estimator("grpo")
    with pytest.raises(ValueError, match="lower-case identifier"):
        register_estimator("My-RLOO")


def test_only_gae_needs_a_critic_among_the_built_ins():
    assert [e.name for e in ESTIMATORS.values() if e.needs_critic] == ["gae"]
    assert {e.name for e in ESTIMATORS.values() if e.needs_groups} == {"reinforce", "rloo", "grpo", "dr_grpo"}


def test_an_estimator_with_a_critic_refuses_a_client_without_values(tmp_path):
    cfg = ppo_cfg(max_steps=1)  # gae: needs the critic's values
    with pytest.raises(TypeError, match="advantage_estimator=gae needs a critic, but the reward client"):
        make_trainer(tmp_path, cfg, client=RewardOnly()).fit()
