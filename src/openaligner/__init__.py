"""openaligner: RLHF with PPO on Hugging Face models, with served reward model and trainable critic."""

__version__ = "0.1.0"
