"""``verifiers:<environment id>``: Prime Intellect's verifiers environments, run unchanged
(``pip install 'loom[verifiers]'`` and the environment's own package).

verifiers (0.3) loads an environment by id: ``verifiers.load_environment(id, **env_args)`` imports the module
named after the id (``-`` read as ``_``) and calls its ``load_environment``. A job names one as
``"env": "verifiers:<id>"`` with ``env_params`` as those arguments. The module is the operator's code: like an
environment by import path it runs only under a prefix of ``LOOM_CODE_ALLOW``, so a client cannot make the
servers import a module by naming it.

A job's tasks are the rows of the environment's dataset (``dataset``, else ``eval_dataset``), by index. The
environment drives its own rollout: its code calls the model through an OpenAI client that Loom answers, one
session per trajectory (``services.envmgr.verifiers_loop``), and its rubric's reward is the trajectory's.
verifiers environments carry no reference replies, so they cannot be scripted.

Missing verifiers, an id no installed module answers, or arguments the environment refuses are refused at
submission (``LibraryMissing``, ``UnknownName``, ``BadParams``: 422).
"""

from __future__ import annotations

import functools
import importlib
import json
import signal
from collections.abc import Mapping
from typing import Any

from loom.envs.adapters import BadParams, LibraryMissing, UnknownName
from loom.identity import allowlist

PACKAGE = "verifiers"
EXTRA = "verifiers"


def library() -> Any:
    try:
        vf = importlib.import_module("verifiers")
        # verifiers formats its datasets with datasets' map: no progress bars in a service's log.
        importlib.import_module("datasets").disable_progress_bars()
        return vf
    except ImportError as e:
        raise LibraryMissing(
            f"verifiers environments need the {PACKAGE} package: pip install 'loom[{EXTRA}]' ({e})"
        ) from e


def module_of(env_id: str) -> str:
    """The module verifiers imports for an environment id (its ``load_environment``: ``owner/name`` is
    ``name``, ``-`` is ``_``)."""
    return env_id.replace("-", "_").split("/")[-1]


def load(env_id: str, params: Mapping[str, Any]) -> Any:
    """The environment, loaded once per process for each set of arguments."""
    return _load(env_id, json.dumps(dict(params), sort_keys=True))


@functools.lru_cache(maxsize=32)
def _load(env_id: str, key: str) -> Any:
    vf = library()
    allowlist.check_code(module_of(env_id))
    try:
        importlib.import_module(module_of(env_id))
    except ImportError as e:
        raise UnknownName(
            f"no verifiers environment {env_id!r}: module {module_of(env_id)!r} is not installed ({e})"
        ) from e
    # A verifiers Environment takes SIGINT and SIGTERM as it is built (to tear itself down and exit): the
    # service's own handlers, which drain it, are put back.
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return vf.load_environment(env_id, **json.loads(key))
    except Exception as e:  # verifiers wraps some of what load_environment raised; any of it is the job's
        raise BadParams(f"verifiers environment {env_id!r} could not be loaded: {e}") from e
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _rows(env_id: str, params: Mapping[str, Any]) -> Any:
    env = load(env_id, params)
    rows = env.dataset if env.dataset is not None else env.eval_dataset
    if rows is None:
        raise BadParams(f"verifiers environment {env_id!r} has no dataset to draw tasks from")
    return rows


def params(name: str, given: Mapping[str, Any]) -> dict[str, Any]:
    _rows(name, given)
    return dict(given)


def task_ids(name: str, params: Mapping[str, Any]) -> list[str]:
    return [str(i) for i in range(len(_rows(name, params)))]


def task(name: str, params: Mapping[str, Any], task_id: str) -> dict[str, Any]:
    """The dataset's row: ``prompt`` (chat messages), ``example_id``, and ``answer``, ``info`` and ``task``
    where it has them: a verifiers ``RolloutInput``."""
    rows = _rows(name, params)
    if not task_id.isdigit() or int(task_id) >= len(rows):
        raise KeyError(f"verifiers environment {name!r} has {len(rows)} tasks: no task {task_id!r}")
    row = dict(rows[int(task_id)])
    return {k: row[k] for k in ("prompt", "example_id", "answer", "info", "task") if row.get(k) is not None}


def statement(record: Mapping[str, Any]) -> str:
    """The prompt's last user message, for prompt-only prediction."""
    users = [m for m in record.get("prompt") or () if isinstance(m, dict) and m.get("role") == "user"]
    content = users[-1].get("content") if users else ""
    return content if isinstance(content, str) else json.dumps(content)


def reference_actions(record: Mapping[str, Any]) -> list[str]:
    raise ValueError("verifiers environments have no reference replies to script")
