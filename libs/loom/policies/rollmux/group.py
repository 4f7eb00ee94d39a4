"""A co-execution group: jobs time-sharing one rollout pool and one training pool (paper §4.1-4.2).

Every job trains on all of the group's training nodes (RollMux adjusts a job's data parallelism to the
training pool instead of resizing the pool, so its training time scales by its own node count over the
pool's, linear DP scaling); its rollout is pinned to a subset of the group's rollout nodes, so rollout
nodes carry different loads. Members' insertion order is the round-robin order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loom.policies.rollmux.cluster import ClusterSpec
from loom.policies.rollmux.job import RLJob
from loom.policies.rollmux.roundrobin import Phase, cycle_and_load, meta_period

EPS = 1e-9


@dataclass(frozen=True)
class Member:
    job: RLJob
    nodes: tuple[int, ...]  # rollout node ids within the group


@dataclass
class Group:
    id: int
    train_nodes: int
    cluster: ClusterSpec
    members: dict[str, Member] = field(default_factory=dict)
    nodes: dict[int, list[str]] = field(default_factory=dict)  # rollout node -> pinned jobs
    next_node: int = 0
    # Summary kept current by add/remove, so that scanning thousands of groups per decision is cheap.
    t_cycle: float = 0.0
    t_load: float = 0.0
    min_budget: float = float("inf")
    train_sum: float = 0.0

    # ---------------------------------------------------------------- effective phase times

    def t_train(self, job: RLJob, shared: bool) -> float:
        t = job.t_train * job.train_nodes / self.train_nodes
        return t + job.train_warm if shared and self.cluster.warm_start else t

    def t_roll(self, job: RLJob, shared: bool) -> float:
        return job.t_roll + job.roll_warm if shared and self.cluster.warm_start else job.t_roll

    def phases(self, extra: Member | None = None) -> list[Phase]:
        """Round-robin phases (rollout nodes, rollout s, training s), optionally with one more member."""
        members = [*self.members.values(), *([extra] if extra else [])]
        pinned: dict[int, int] = {n: len(js) for n, js in self.nodes.items()}
        if extra:
            for n in extra.nodes:
                pinned[n] = pinned.get(n, 0) + 1
        shared_train = len(members) > 1
        return [
            Phase(
                m.nodes,
                self.t_roll(m.job, any(pinned[n] > 1 for n in m.nodes)),
                self.t_train(m.job, shared_train),
            )
            for m in members
        ]

    # ---------------------------------------------------------------- the paper's quantities

    def saturated(self) -> bool:
        """No slack left: the bottleneck's work fills the longest member's cycle (Algorithm 1, line 4)."""
        return bool(self.members) and self.t_load >= self.t_cycle - EPS

    def _refresh(self) -> None:
        ps = self.phases()
        self.t_cycle, self.t_load = cycle_and_load(ps)
        self.train_sum = sum(p.train for p in ps)
        self.min_budget = min((m.job.budget for m in self.members.values()), default=float("inf"))

    def period(self, extra: Member | None = None) -> float:
        """Iteration time of every member under the round robin (all run once per meta-iteration)."""
        return meta_period(self.phases(extra))

    def cost(self) -> float:
        return self.cluster.cost(len(self.nodes), self.train_nodes)

    def utilisation(self) -> float:
        """Busy node-seconds over provisioned node-seconds in one meta-iteration."""
        ps = self.phases()
        if not ps:
            return 0.0
        t = meta_period(ps)
        busy = sum(p.roll * len(p.nodes) + p.train * self.train_nodes for p in ps)
        return busy / ((len(self.nodes) + self.train_nodes) * t)

    # ---------------------------------------------------------------- residency

    def roll_mem_free(self, node: int) -> float:
        used = sum(self.members[j].job.roll_mem for j in self.nodes[node])
        return self.cluster.roll_node_mem_gb - used

    def train_mem_free(self) -> float:
        return self.cluster.train_node_mem_gb - sum(m.job.train_mem for m in self.members.values())

    def fits(self, job: RLJob, nodes: tuple[int, ...]) -> bool:
        """Memory residency and group size for ``job`` pinned to ``nodes`` (new node ids allowed)."""
        if len(self.members) >= self.cluster.max_group_size:
            return False
        if job.train_mem > self.train_mem_free() + EPS:
            return False
        cap = self.cluster.roll_node_mem_gb
        return all(job.roll_mem <= (self.roll_mem_free(n) if n in self.nodes else cap) + EPS for n in nodes)

    # ---------------------------------------------------------------- membership

    def new_nodes(self, k: int) -> tuple[int, ...]:
        return tuple(range(self.next_node, self.next_node + k))

    def add(self, job: RLJob, nodes: tuple[int, ...]) -> None:
        if job.id in self.members:
            raise ValueError(f"job {job.id!r} is already in group {self.id}")
        self.members[job.id] = Member(job, nodes)
        for n in nodes:
            self.nodes.setdefault(n, []).append(job.id)
            self.next_node = max(self.next_node, n + 1)
        self._refresh()

    def remove(self, job_id: str) -> Member:
        """Take a job out; rollout nodes nobody is pinned to any more are released."""
        m = self.members.pop(job_id)
        for n in m.nodes:
            self.nodes[n].remove(job_id)
            if not self.nodes[n]:
                del self.nodes[n]
        self._refresh()
        return m
