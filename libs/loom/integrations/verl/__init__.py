"""Loom as the rollout of verl's PPO trainer (the ``verl`` extra).

``actor_rollout_ref.rollout.agent.agent_loop_manager_class=loom.integrations.verl.LoomAgentLoopManager`` with
``+loom.url=... +loom.env=coin`` runs each batch verl hands its rollout as one Loom job (a group per distinct
prompt, ``rollout.n`` samples each) and hands back what verl's trainer reads: the ``DataProto`` of the classic
trainer, or, under the v1 trainer (``sync`` mode), the samples written to TransferQueue; multi-turn responses
with the environment's tokens masked, the engine's log-probabilities, Loom's reward at the last token. The fleet
follows verl's saved checkpoints, or, with ``LoomCheckpointManager`` as verl's
``rollout.checkpoint_manager_class``, takes each step's weights in memory (``loom.integrations.verl.checkpoint``).
``LoomAgentLoop`` (registered as ``loom``) does one sample at a time for a
trainer that keeps verl's own manager.
"""

from loom.integrations.verl.agent_loop import LoomAgentLoop
from loom.integrations.verl.batch import to_dataproto
from loom.integrations.verl.checkpoint import LoomCheckpointEngine, LoomCheckpointManager
from loom.integrations.verl.config import LoomConfig, loom_config
from loom.integrations.verl.manager import LoomAgentLoopManager
from loom.integrations.verl.samples import Sample, sample_of

__all__ = [
    "LoomAgentLoop",
    "LoomAgentLoopManager",
    "LoomCheckpointEngine",
    "LoomCheckpointManager",
    "LoomConfig",
    "Sample",
    "loom_config",
    "sample_of",
    "to_dataproto",
]
