"""The recorded data workloads replay: traces of trajectories, and the named trace sets."""
