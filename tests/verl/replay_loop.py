"""An agent loop (registered in verl as ``replay``) that returns the outputs it is given, by prompt and session:
run inside verl's own v1 worker, it has verl write to TransferQueue what verl writes for samples Loom made."""

from __future__ import annotations

from typing import Any, ClassVar

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register


@register("replay")
class ReplayLoop(AgentLoopBase):
    # (uid, session) -> what the loop returns for that sample.
    outputs: ClassVar[dict[tuple[str, int], AgentLoopOutput]] = {}

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        # A copy: verl's worker writes into the output it is handed.
        return self.outputs[(kwargs["uid"], kwargs["session_id"])].model_copy(deep=True)
