"""Durable outputs: atomic checkpoints and metric sinks (JSONL, TensorBoard, W&B)."""
