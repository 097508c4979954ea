"""``openaligner train-ppo [CONFIG] [key=value ...]``: the PPO actor, connected to the served critic/RM.

Builds the actor, optimizer, scheduler, prompt loaders, client, logger and checkpoint manager
from the config, resumes automatically from the newest complete checkpoint whose critic the
critic server holds (sending the server back to that critic), and runs :class:`PPOTrainer`.
Under ``torchrun`` every rank runs this; rank 0 logs and saves.

Exit codes: 0 when the run finished (or reached ``max_time_per_run``, after saving); 1 when a
server failed or could not be reached (the message names host:port and model; under torchrun
every rank stops at once), the critic server holds the critic of none of the checkpoints, or the
actor's gradients were inf/NaN too many steps in a row; 2 when the run is refused at start-up,
before any weights load or a server is contacted (prompt files, too few prompts for one batch,
``data.seq_length`` beyond the actor's positions); 130 on SIGINT and
143 on SIGTERM, which stop the run at once without saving — the next run of the same command
resumes from the last checkpoint. Resuming also rewinds ``logs/metrics.jsonl``,
``logs/tables.jsonl`` and ``logs/rollouts.jsonl`` to the checkpoint's step, so steps that are run
again appear once.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from types import FrameType

from openaligner.trainer.ppo_config import TrainPPOConfig

SCHEMA = TrainPPOConfig


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C's KeyboardInterrupt (exit code 143)."""


def _raise_terminated(_signum: int, _frame: FrameType | None) -> None:
    raise Terminated


def run(cfg: TrainPPOConfig) -> int:
    """Train; see the module docstring for the exit codes."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _train(cfg)
    except KeyboardInterrupt as e:
        name, code = ("SIGTERM", 143) if isinstance(e, Terminated) else ("SIGINT", 130)
        note = _resume_note(Path(cfg.exp.output_dir), cfg.trainer.uses_critic)
        print(
            f"openaligner train-ppo: stopped by {name}; {note}",
            file=sys.stderr,
            flush=True,
        )
        return code
    finally:
        signal.signal(signal.SIGTERM, previous)


def _resume_note(out: Path, uses_critic: bool = True) -> str:
    from openaligner.io.checkpoint import CheckpointManager

    latest = CheckpointManager(out / "checkpoints").latest()
    if latest is None:
        return "no checkpoint was written yet, so the same command starts over"
    if not uses_critic:
        return f"the same command resumes from {latest}"
    return (
        f"the same command resumes from {latest} and sends the critic server back to the critic saved "
        f"with it (restart serve-critic with the same checkpoint.dir if it is not running)"
    )


def _train(cfg: TrainPPOConfig) -> int:
    from openaligner import distributed as dp
    from openaligner.clients.critic import RemoteGPTRMCriticClient, TokenizerMismatchError
    from openaligner.clients.errors import ClientError
    from openaligner.clients.reward_only import RemoteRewardOnlyClient
    from openaligner.config import StartupError, as_startup_error
    from openaligner.distributed import PeerFailedError
    from openaligner.trainer.ppo import NonFiniteTrainingError, PPOTrainer
    from openaligner.trainer.ppo_checkpoint import ResumeError
    from openaligner.trainer.ppo_recipe import prepare_ppo_run, run_ppo

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
    except (ClientError, PeerFailedError, NonFiniteTrainingError, ResumeError) as e:
        stopped = ""
        if started:
            note = _resume_note(run.output_dir, cfg.trainer.uses_critic)
            stopped = f" The run stopped at step {started[0].step}; {note}."
        print(f"openaligner train-ppo: {e}{stopped}", file=sys.stderr, flush=True)
        return 1
    return 0
