"""Hardware affinity (RollArt §4, Listings 1-2): a job maps task tags to GPU types, and a task's trajectories
run only on workers of its type.

``{"coding": "h800", "default": "h20"}`` sends coding to H800 workers and every other tag to H20. A tag with
no entry and no ``default`` may run anywhere, and so may a tag whose GPU type no worker has: an affinity is a
preference about speed and cost, and stranding a task on hardware that is absent helps neither.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

DEFAULT = "default"


def gpu_for(affinity: Mapping[str, str] | None, tag: str) -> str | None:
    """The GPU type ``tag`` maps to: its own entry, else the default, else None (any)."""
    if not affinity:
        return None
    gpu = affinity.get(tag, affinity.get(DEFAULT))
    return gpu.lower() if gpu else None


def eligible(gpus: Sequence[str], affinity: Mapping[str, str] | None, tag: str) -> list[int]:
    """Indices of the workers (by GPU type) that ``tag``'s trajectories may run on."""
    want = gpu_for(affinity, tag)
    mine = [i for i, g in enumerate(gpus) if want is not None and g.lower() == want]
    return mine or list(range(len(gpus)))
