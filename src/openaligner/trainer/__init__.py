"""Training: PPO (PPOTrainer), the critic's trainer (CriticTrainer, driven by the critic server),
SFT and reward-model training, and the optimizer step and checkpoint files PPO and the critic
share."""
