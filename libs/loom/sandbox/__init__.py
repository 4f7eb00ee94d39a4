"""Sandboxes for tools and rewards: Docker containers over the Engine API, a process fallback, a warm pool."""

from loom.sandbox.types import ExecResult, Limits, Sandbox, SandboxError, SandboxUnavailable

__all__ = ["ExecResult", "Limits", "Sandbox", "SandboxError", "SandboxUnavailable"]
