"""Environments of other libraries, one adapter module each, named in ``loom.envs.registry.KINDS`` by prefix
(``reasoning_gym:<dataset>``). The library is an optional dependency: nothing here imports it until a job
names one of its environments.

An adapter module provides (``Adapter``): the tasks of a named environment of the library under the job's
``env_params`` (ids, and each task's record, generated again identically in any process), a record's
statement and scripted actions, and the environment a trajectory runs (``loom.envs.base.Env``). What the
library's code raises or where it hangs fails only that trajectory (``LibraryError``); a job spec it cannot
serve is refused at submission (``LibraryMissing``, ``UnknownName``, ``BadParams``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from loom.envs import tasksets
from loom.envs.base import Env

T = TypeVar("T")


class LibraryMissing(ValueError):
    """The library is not installed in this process's environment."""


class UnknownName(ValueError):
    """The library has no environment (dataset) of that name."""


class BadParams(ValueError):
    """The job's ``env_params`` are not what the library's environment accepts."""


class LibraryError(Exception):
    """The library's code raised, or did not return in time, while running a trajectory (not retried)."""


async def in_thread(
    label: str,
    what: str,
    fn: Callable[[], T],
    timeout_s: float | None = None,
    passthrough: tuple[type[BaseException], ...] = (),
) -> T:
    """Library code, in a thread (a thread cannot be stopped: one that hangs is left), under ``timeout_s`` where
    given (else the caller's own timeout applies). What it raises fails the trajectory as a ``LibraryError``
    naming ``label`` (whose code) and ``what`` (which call); Loom's own errors, and ``passthrough``, go through."""
    ours: tuple[type[BaseException], ...] = (LibraryMissing, LibraryError, *passthrough)
    try:
        async with asyncio.timeout(timeout_s):
            return await asyncio.to_thread(fn)
    except ours:
        raise
    except Exception as e:
        if isinstance(e, TimeoutError) and timeout_s is not None:
            raise LibraryError(f"{label}: {what} did not return within {timeout_s:g} s") from None
        raise LibraryError(f"{label}: {what} raised {type(e).__name__}: {e}") from e


def gsm8k(split: str, reader: str) -> dict[str, tasksets.MathTask]:
    """Loom's GSM8K tasks of ``split``, which a library's GSM8K environments (``reader``) are given."""
    try:
        return tasksets.gsm8k(None, split)
    except (OSError, KeyError) as e:
        raise ValueError(f"{reader} Loom's GSM8K data: {e}") from e


class Adapter(Protocol):
    # The distribution and the Loom extra that install the library (for the error a missing library gives).
    PACKAGE: str
    EXTRA: str

    def params(self, name: str, given: Mapping[str, Any]) -> dict[str, Any]:
        """The parameters the environment runs under (the given ones, defaults filled in so that every process
        generates the same tasks); UnknownName, BadParams or LibraryMissing when they cannot be served."""
        ...

    def task_ids(self, name: str, params: Mapping[str, Any]) -> list[str]: ...

    def task(self, name: str, params: Mapping[str, Any], task_id: str) -> Any:
        """The record of a task (KeyError for an id the set does not have)."""
        ...

    def statement(self, record: Any) -> str: ...

    def reference_actions(self, record: Any) -> list[str]:
        """The actions that solve the task; ValueError when the record has no reference answer. On the user
        loop a scripted reply is the Environment's ``reference_action()`` at each turn (it may depend on what the
        environment said), and this only checks, at submission, that the task can be scripted."""
        ...

    def make(self, name: str, params: Mapping[str, Any], task_id: str, timeout_s: float) -> Env:
        """The environment of one trajectory, for a library on the built-in loop (``Library(loop="env")``)."""
        ...

    def environment(self, name: str) -> Any:
        """For a library on the user loop (``Library(loop="user")``): the ``loom.envs.api.Environment`` class
        the environment manager makes per trajectory with the job's ``env_params`` (keyword arguments, and a
        ``sandbox`` where the class sets ``needs_sandbox``). Its ``reset`` gets the task's data: ``set`` (the
        job's env), ``task_id``, ``params`` (the parameters ``params`` returned) and ``prompt``."""
        ...
