"""``LoomGRPOTrainer``: TRL's ``GRPOTrainer`` with its truncated importance sampling applied to Loom's samples.

Stock TRL computes ``importance_sampling_ratio`` (the trainer's log-probabilities of the sampled tokens against
the sampler's, truncated per ``vllm_importance_sampling_mode`` and ``_clip_max``/``_clip_min``) and multiplies
the per-token loss by it only when it generates with vLLM itself (``use_vllm``). Loom's rollouts carry the
engine's log-probabilities (``sampling_per_token_logps``), so the same correction applies: this subclass
computes the ratio from them exactly as TRL's vLLM path does and lets TRL's own loss use it. Samples of stale
weights (an asynchronous bound above 0, a fleet moved mid-job) are then trained on correctly instead of being
masked out.
"""

from __future__ import annotations

from typing import Any

import torch
from trl import GRPOTrainer


class LoomGRPOTrainer(GRPOTrainer):
    corrects_off_policy = True

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        out: dict[str, Any] = super()._generate_and_score_completions(inputs)
        args: Any = self.args  # trl.GRPOConfig
        sampling = out.get("sampling_per_token_logps")
        if sampling is None or not args.vllm_importance_sampling_correction:
            return out
        old = out.get("old_per_token_logps")
        if old is None:
            ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
            attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
            with torch.no_grad():
                old, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, ids, attention, out["completion_ids"].size(1)
                )
            out["old_per_token_logps"] = old
        mask = out["completion_mask"] * out.get("tool_mask", torch.ones_like(out["completion_mask"]))
        # What TRL's vLLM path logs: how far the engine's log-probabilities stray from the trainer's.
        delta = torch.abs(old - sampling)[mask.bool()]
        delta = delta[~torch.isnan(delta)]
        metrics = self._metrics["train" if self.model is not None and self.model.training else "eval"]
        # Over every process's rows, as TRL gathers them (a collective: every rank takes part, rows or none).
        zero = torch.tensor(0.0, device=self.accelerator.device)
        mean, most = (delta.mean(), delta.max()) if delta.numel() else (zero, zero)
        metrics["sampling/sampling_logp_difference/mean"].append(self.accelerator.gather(mean).mean().item())
        metrics["sampling/sampling_logp_difference/max"].append(self.accelerator.gather(most).max().item())
        diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
        mode = args.vllm_importance_sampling_mode
        if mode.startswith("sequence"):
            diff = diff.sum(dim=-1, keepdim=True)
        ratio = torch.exp(diff)
        lo, hi = args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max
        if mode.endswith("truncate"):
            ratio = torch.clamp(ratio, min=lo, max=hi)
        else:
            bad = (ratio < (lo if lo is not None else -torch.inf)) | (
                ratio > (hi if hi is not None else torch.inf)
            )
            ratio = ratio.masked_fill(bad, 0.0)
        out["importance_sampling_ratio"] = ratio
        return out

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        if "importance_sampling_ratio" not in inputs:
            return super()._compute_loss(model, inputs)
        # TRL's loss multiplies by the ratio under ``use_vllm`` alone; nothing else in it reads the flag.
        use_vllm, self.use_vllm = self.use_vllm, True
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self.use_vllm = use_vllm
