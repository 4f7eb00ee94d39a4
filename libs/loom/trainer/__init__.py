"""Training with Loom: the trainer SDK (rollout streams, batches, weight updates) and a GRPO trainer."""
