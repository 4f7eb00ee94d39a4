"""The benchmark harness: workloads on simulated clusters, in virtual time, under Loom's and the baselines'
policies (the same classes the services run)."""
