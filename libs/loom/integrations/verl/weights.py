"""The weight hand-off, driven by verl's checkpoint saving (unless verl moves the fleet in memory:
``loom.integrations.verl.checkpoint``).

With ``hf_model`` in ``actor_rollout_ref.actor.checkpoint.save_contents`` and ``trainer.save_freq`` set, verl
writes ``{trainer.default_local_dir}/global_step_N/actor/huggingface/`` (``actor/model/huggingface/`` from a
Megatron actor: config, tokenizer and the whole model's weights) after step N's update. Before Loom runs the next batch, the fleet moves to the newest such checkpoint it
does not serve yet, all or nothing, as version N; every trajectory then says which steps' weights made it
(``min_global_steps``/``max_global_steps``). With ``save_freq`` k the fleet runs up to k - 1 steps behind: the
samples carry the engine's log-probabilities (``rollout_log_probs``) for verl's rollout correction.
"""

from __future__ import annotations

import asyncio
import re
import weakref
from pathlib import Path
from typing import Any

import httpx

from loom.integrations.fleet import push
from loom.integrations.verl.checkpoint import MANAGER, in_memory

STEP_DIR = re.compile(r"global_step_(\d+)")
# Where verl's actors write the whole model under a step's directory: FSDP's checkpoint manager, and Megatron's
# (verl.utils.megatron_utils.get_hf_model_checkpoint_path: model/huggingface since its layout v2).
HF_EXPORTS = ("actor/huggingface", "actor/model/huggingface")


def hf_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """verl's checkpoints under ``root`` that hold a whole Hugging Face model, by step."""
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        m = STEP_DIR.fullmatch(d.name)
        if not m:
            continue
        for hf in (d / rel for rel in HF_EXPORTS):
            if any(hf.glob("*.safetensors")) or (hf / "pytorch_model.bin").is_file():
                out.append((int(m.group(1)), hf.resolve()))
                break
    return sorted(out)


def weight_sync(config: Any, root: Path, model: str) -> WeightSync | None:
    """How the rollout moves the fleet under verl's ``config``: not at all (verl moves it in memory, through
    Loom's checkpoint manager), or following the checkpoints under ``root``, which verl must then write whole:
    a fleet that never moved would say nothing."""
    if in_memory(config):
        return None
    checkpoint = config.actor_rollout_ref.actor.get("checkpoint") or {}
    if (
        "hf_model" not in list(checkpoint.get("save_contents") or [])
        or int(config.trainer.get("save_freq", -1)) <= 0
    ):
        raise ValueError(
            "Loom's fleet would never get verl's weights: move them in memory "
            f"(+actor_rollout_ref.rollout.checkpoint_manager_class={MANAGER}, see loom.integrations.verl.checkpoint) "
            "or have verl save the whole model ('actor_rollout_ref.actor.checkpoint.save_contents=[...,hf_model]' "
            "and trainer.save_freq > 0)"
        )
    return WeightSync(root, model)


class WeightSync:
    """The fleet of ``model`` as far as this process moved it (or found it moved)."""

    def __init__(self, root: Path, model: str) -> None:
        self.root = root
        self.model = model
        self.version = 0
        # The agent loops of one verl worker share an event loop; its manager runs each batch on a new one.
        self._locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )

    def newer(self) -> tuple[int, Path] | None:
        found = [c for c in hf_checkpoints(self.root) if c[0] > self.version]
        return found[-1] if found else None

    async def sync(self, http: httpx.AsyncClient) -> int:
        """Move the fleet to the newest checkpoint after the version it serves; that version after."""
        if self.newer() is None:
            return self.version
        loop = asyncio.get_running_loop()
        lock = self._locks.setdefault(loop, asyncio.Lock())
        async with lock:
            newest = self.newer()  # another sample of this worker may have moved it while this one waited
            if newest is not None:
                step, path = newest
                self.version = max(self.version, await push(http, self.model, step, path))
        return self.version
