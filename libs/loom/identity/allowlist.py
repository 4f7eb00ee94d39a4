"""What a job spec may point the servers at: the operator decides, never the REST client.

- Code by import path (``"reward": "pkg.mod:fn"``) only from modules under the prefixes in
  ``LOOM_CODE_ALLOW`` (comma-separated, e.g. ``my_rewards,acme.rl``); with none set only the built-ins run.
  The scheduler refuses a spec that names other code, and the reward worker refuses to import it, so a module's
  top-level code never runs because a client asked.
- Data files (``dataset.path``, a task's ``path``) only inside the directories in ``LOOM_DATA_DIRS``
  (``os.pathsep``-separated; by default the shared ``data`` directory), regular files of at most
  ``LOOM_DATA_MAX_MB`` (512). A refusal says the same whether or not the file exists outside them.
"""

from __future__ import annotations

import importlib
import os
import stat
from pathlib import Path
from typing import Any

from loom.settings import default_shared_dir

CODE_ALLOW_ENV = "LOOM_CODE_ALLOW"
DATA_DIRS_ENV = "LOOM_DATA_DIRS"
DATA_MAX_MB_ENV = "LOOM_DATA_MAX_MB"
DEFAULT_DATA_MAX_MB = 512


class NotLoaded(ValueError):
    """Code by import path that cannot be run: not allowed, not importable, or not callable."""


class NotAllowed(NotLoaded):
    """A spec names code or a file the operator has not allowed."""


def code_prefixes() -> tuple[str, ...]:
    return tuple(p.strip() for p in os.environ.get(CODE_ALLOW_ENV, "").split(",") if p.strip())


def check_code(path: str) -> None:
    """``path`` is ``module:name``; its module must lie under an allowed prefix."""
    module = path.partition(":")[0]
    for prefix in code_prefixes():
        if module == prefix or module.startswith(prefix + "."):
            return
    raise NotAllowed(
        f"{path!r} is not in the operator's allowlist ({CODE_ALLOW_ENV}); only built-in functions and "
        "modules under its prefixes may run"
    )


def load(path: str, what: str) -> Any:
    """The callable ``module:name`` names (``what`` it is: "reward function", "environment"), imported only
    when allowed: NotAllowed, else NotLoaded saying why it cannot be loaded."""
    check_code(path)
    module, _, name = path.partition(":")
    try:
        found = getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise NotLoaded(f"cannot load {what} {path!r}: {e}") from e
    except AttributeError as e:
        raise NotLoaded(f"cannot load {what} {path!r}: {module} has no {name!r}") from e
    if not callable(found):
        raise NotLoaded(f"{what} {path!r} is not callable")
    return found


def data_dirs() -> tuple[Path, ...]:
    raw = os.environ.get(DATA_DIRS_ENV)
    dirs = [Path(p) for p in raw.split(os.pathsep) if p] if raw else [default_shared_dir() / "data"]
    return tuple(d.resolve() for d in dirs)


def check_data_file(path: str) -> Path:
    """The resolved file, if it lies inside an allowed data directory and may be read whole."""
    resolved = Path(path).expanduser().resolve()
    dirs = data_dirs()
    if not any(resolved.is_relative_to(d) for d in dirs):
        raise NotAllowed(f"{path!r} is not inside the data directories ({DATA_DIRS_ENV})")
    try:
        st = resolved.stat()
    except OSError:
        raise NotAllowed(f"{path!r} does not exist") from None
    if not stat.S_ISREG(st.st_mode):
        raise NotAllowed(f"{path!r} is not a regular file")
    limit = float(os.environ.get(DATA_MAX_MB_ENV, DEFAULT_DATA_MAX_MB)) * 2**20
    if st.st_size > limit:
        raise NotAllowed(f"{path!r} is {st.st_size / 2**20:.0f} MB, over the {limit / 2**20:.0f} MB limit")
    return resolved
