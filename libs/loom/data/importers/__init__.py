"""Rollout dumps that trainers already write, read into the rollout-trace schema (``loom.data.rollout_trace``):
``loom trace import TRAINER PATH``. Each module says what its trainer's dump holds and what it does not."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from loom.data import rollout_trace as rt
from loom.data.importers.skyrl import from_skyrl
from loom.data.importers.slime import from_slime
from loom.data.importers.verl import from_verl

Importer = Callable[[str | Path], Iterator[rt.Trajectory]]

IMPORTERS: dict[str, Importer] = {"verl": from_verl, "slime": from_slime, "skyrl": from_skyrl}

__all__ = ["IMPORTERS", "from_skyrl", "from_slime", "from_verl"]
