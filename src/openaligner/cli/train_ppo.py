"""``openaligner train-ppo [CONFIG] [key=value ...]``: the PPO actor, connected to the served critic/RM.

Owns the command: build the run from the config (:mod:`openaligner.trainer.ppo_recipe`), resume
from the newest checkpoint the critic server also holds, run :class:`PPOTrainer`, and map the
outcome to exit codes (0 done, 1 server or training failure, 2 refused at start-up, 130/143 on a
signal). Must not know the PPO math or the wire format.
Design notes: docs/ppo.md, "Module notes".
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from openaligner.cli.training import configure_logging, stop_on_signals
from openaligner.trainer.ppo_config import TrainPPOConfig

if TYPE_CHECKING:
    from openaligner.trainer.ppo import PPOTrainer

SCHEMA = TrainPPOConfig
RESUME_KEY = "exp.resume"  # the key that makes the same command continue from the newest checkpoint


def run(cfg: TrainPPOConfig) -> int:
    """Train; see the module docstring for the exit codes. A signal stops the run at once
    (:func:`~openaligner.cli.training.stop_on_signals`): the PPO loop does not poll for a stop,
    because its step's checkpoint needs the critic server's too."""
    from openaligner.io.checkpoint import CheckpointManager

    checkpoints = CheckpointManager(Path(cfg.exp.output_dir) / "checkpoints")
    with stop_on_signals("train-ppo", checkpoints.latest, _CRITIC_ADVICE if cfg.trainer.uses_critic else ""):
        return _train(cfg)


_CRITIC_ADVICE = (
    " and sends the critic server back to the critic saved with it (restart serve-critic with the same "
    "checkpoint.dir if it is not running)"
)


def _resume_note(out: Path, uses_critic: bool = True) -> str:
    from openaligner.io.checkpoint import CheckpointManager

    latest = CheckpointManager(out / "checkpoints").latest()
    if latest is None:
        return "no checkpoint was written yet, so the same command starts over"
    return f"the same command resumes from {latest}{_CRITIC_ADVICE if uses_critic else ''}"


_SUMMARY_KEYS = ("rollout/rewards", "rollout/score", "rollout/init_policy_kl", "val/rewards", "val/score")


def closing_line(estimator: str, trainer: PPOTrainer, actor_dir: Path) -> str:
    """``train-ppo: GRPO, steps A → B; rollout/rewards=…, …; actor saved to <dir>``: the line a
    finished run prints, as train-sft and train-rm print theirs."""
    from openaligner.trainer.ppo_config import algorithm_name

    name = algorithm_name(estimator)
    if not trainer.history:  # resumed at the run's last step: nothing ran, nothing to summarise
        return (
            f"train-ppo: {name}, step {trainer.step}: no step left to run (the checkpoint it resumed "
            f"from is at the run's last step); actor saved to {actor_dir}"
        )
    last = trainer.history[-1]
    summary = ", ".join(f"{k}={last[k]:.4g}" for k in _SUMMARY_KEYS if k in last)
    steps = f"steps {trainer.step - len(trainer.history)} → {trainer.step}"
    return f"train-ppo: {name}, {steps}; {summary or 'no metrics'}; actor saved to {actor_dir}"


def _train(cfg: TrainPPOConfig) -> int:
    from openaligner import distributed as dp
    from openaligner.clients.critic import RemoteGPTRMCriticClient, TokenizerMismatchError
    from openaligner.clients.errors import ClientError
    from openaligner.clients.reward_only import RemoteRewardOnlyClient
    from openaligner.config import StartupError, as_startup_error
    from openaligner.distributed import PeerFailedError
    from openaligner.trainer.ppo import NonFiniteTrainingError
    from openaligner.trainer.ppo_checkpoint import ResumeError
    from openaligner.trainer.ppo_recipe import prepare_ppo_run, run_ppo

    configure_logging()
    dp.init_from_env()
    run = prepare_ppo_run(cfg)  # StartupError (exit 2) before any weights load or server is contacted
    if cfg.remote.pad_to_length is None:
        # Requests of one fixed width merge in Triton's dynamic batcher (NeMo-Aligner's default).
        cfg.remote.pad_to_length = cfg.data.seq_length
    started: list[PPOTrainer] = []
    log = logging.getLogger(__name__)
    # PPO (gae) talks to the critic server (and the reward server, when separate); the critic-free
    # estimators only to the reward server at remote.reward_model.
    client_type = RemoteGPTRMCriticClient if cfg.trainer.uses_critic else RemoteRewardOnlyClient
    if not cfg.trainer.uses_critic:
        r = cfg.remote.reward_model
        log.info(
            "trainer.advantage_estimator=%s: no critic; rewards from the reward server at %s:%d",
            cfg.trainer.advantage_estimator,
            r.ip,
            r.port,
        )
    try:
        with client_type(cfg.remote) as client:
            metadata = run.conversations.metadata if run.conversations.has_metadata else None
            with as_startup_error(TokenizerMismatchError):
                mode = client.configure_reward_input(run.tokenizer, run.conversations, metadata)
            if metadata is not None and mode != "text":
                raise StartupError(
                    "data.metadata_keys names prompt fields for the reward server, but rollouts reach it as "
                    "token ids (remote.reward_input=tokens), which carry no metadata: serve a reward "
                    "function or a reward model with its tokenizer, and set remote.reward_input=text or auto"
                )
            log.info("the reward model reads %s (remote.reward_input=%s)", mode, cfg.remote.reward_input)
            run_ppo(run, client, on_trainer=started.append)
        dp.shutdown()
        if dp.is_leader():
            print(closing_line(cfg.trainer.advantage_estimator, started[0], run.output_dir / "actor"))
    except (ClientError, PeerFailedError, NonFiniteTrainingError, ResumeError) as e:
        stopped = ""
        if started:
            note = _resume_note(run.output_dir, cfg.trainer.uses_critic)
            stopped = f" The run stopped at step {started[0].step}; {note}."
        print(f"openaligner train-ppo: {e}{stopped}", file=sys.stderr, flush=True)
        return 1
    return 0
