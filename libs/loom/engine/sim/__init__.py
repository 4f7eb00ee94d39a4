"""The simulated engine: continuous batching, a radix prefix cache, priorities and preemption, priced by the
performance model (``loom.engine.model``); in real time behind a rollout worker, in virtual time in the harness."""
