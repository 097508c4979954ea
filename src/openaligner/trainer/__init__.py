"""Training loops: PPO (PPOTrainer), SFT and reward-model training, and their state."""
