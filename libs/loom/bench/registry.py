"""What a benchmark plugs into ``loom bench``: its name, its own flags and its run function."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Benchmark:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    # Prints its tables and returns its result; ``loom bench`` prints that as the JSON line under --json.
    run: Callable[[argparse.Namespace], dict[str, Any]]
