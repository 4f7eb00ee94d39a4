"""RollMux co-scheduling of many RL jobs on shared rollout and training pools (pure policies).

``cluster``: GPU types, prices, node memory; ``job``: an RL job's worst-case phase profile and footprint;
``group``: a co-execution group and its load, cycle and cost; ``roundrobin``: the intra-group round robin
(its steady-state meta-iteration and a live executor that issues phase permits) and long-tail migration;
``intergroup``: Algorithm 1 and the baselines; ``optimal``: the offline optimum by brute force.
"""
