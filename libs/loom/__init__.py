"""Loom: rollout system for agentic RL. Importable shared code; services live in services/."""

__version__ = "0.1.0"
