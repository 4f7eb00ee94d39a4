"""Loom as the rollout of TRL's ``GRPOTrainer`` (the ``trl`` extra).

``GRPOTrainer(..., rollout_func=LoomRollout(url, token, env="coin", dataset="coin", model="qwen3-tiny"),
reward_funcs=loom_reward)``: each call runs the prompts TRL hands over as one Loom job, its groups the distinct
prompts and their ``num_generations`` samples, and hands back what TRL reads. ``LoomGRPOTrainer`` also corrects
for samples of weights other than the trainer's (TRL's truncated importance sampling, which stock TRL applies
on its own vLLM path only).
"""

from loom.integrations.trl.rollout import LoomRollout, loom_reward, rows_of
from loom.integrations.trl.trainer import LoomGRPOTrainer

__all__ = ["LoomGRPOTrainer", "LoomRollout", "loom_reward", "rows_of"]
