"""Inference engines behind the rollout service: one interface, simulated and SGLang implementations."""
