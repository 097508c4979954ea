"""Datasets: prompts for PPO, SFT pairs and preference pairs, read from local files."""
