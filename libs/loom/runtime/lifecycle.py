"""Process lifecycle of Loom's own commands: a SIGTERM stops them as Ctrl-C does, and what they start never
outlives them.

``loom up``, ``loom train`` and ``loom demo`` start a nats-server and the services as children in sessions of
their own (so that a Ctrl-C at the terminal reaches the parent alone, which stops them in order). Job
schedulers and ``timeout`` send SIGTERM instead: ``sigterm_as_interrupt`` makes it take the Ctrl-C path, and
``dies_with_me``, run in each child before it execs, has the kernel send the child SIGTERM if its parent dies
any other way (SIGKILL, a crash), so that no child is ever orphaned.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
from collections.abc import Callable
from types import FrameType

_PR_SET_PDEATHSIG = 1


def dies_with_me() -> Callable[[], None] | None:
    """A ``preexec_fn`` for a child of this process: the kernel sends the child SIGTERM when the thread that
    forked it exits (Linux; elsewhere None, nothing to run)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child only calls it
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        # The parent may have died between fork and prctl: then this process was re-parented already.
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


_terminated = False


def _interrupt(signum: int, frame: FrameType | None) -> None:
    # As if Ctrl-C had been pressed: asyncio.run cancels its main task (finally blocks stop the children),
    # and synchronous code gets KeyboardInterrupt.
    global _terminated
    _terminated = True
    os.kill(os.getpid(), signal.SIGINT)


def stop_if_terminated() -> None:
    """KeyboardInterrupt, the Ctrl-C path, if this process got SIGTERM. asyncio.run turns the signal into one
    cancellation of its main task, and code that suppresses CancelledError while it waits on a task of its own
    (``task.cancel(); with suppress(CancelledError): await task``, in Loom and in libraries) swallows it if it
    lands there: the command then goes on as if nothing happened (``loom train`` once trained on and started
    its next mode). A long command calls this between its stages."""
    if _terminated:
        raise KeyboardInterrupt("SIGTERM")


def sigterm_as_interrupt() -> None:
    """Handle SIGTERM in this process as SIGINT (Ctrl-C). Call it once, in the main thread, at start."""
    signal.signal(signal.SIGTERM, _interrupt)


def free_port() -> int:
    """A TCP port free on the loopback now, for a child to listen on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
