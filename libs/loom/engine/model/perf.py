"""Roofline performance model of one engine iteration: GPU datasheet x model config x efficiencies.

An iteration's time is a fixed overhead, plus the larger of its compute time and its memory time (each at
an achieved fraction of the datasheet peak) and the exposed part of the smaller one, plus the tensor-parallel
all-reduces. The efficiencies live in one table keyed by GPU so that calibration against measured points
(``loom.bench.engine_calibration``) replaces numbers, not code.

Per-token time and the interference factor are Heddle's T and alpha (its F of a group): the time between two
tokens of one sequence decoding in a batch, and that time over the batch-1 time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_GIB = 1024**3
_BF16 = 2  # bytes per weight and per KV element


@dataclass(frozen=True)
class GpuSpec:
    name: str
    bf16_tflops: float  # dense
    mem_bw_tbps: float
    memory_gib: float
    nvlink_gbps: float  # datasheet figure, both directions together
    # Host-to-device per GPU, effective: PCIe Gen5 x16 is 64 GB/s a direction on paper and about 50 GB/s
    # pinned in practice; half that, as eight GPUs share the host's memory channels and a KV load gathers
    # pages (Gen4 on the A100).
    host_link_gbps: float = 25.0


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("h100", bf16_tflops=989.0, mem_bw_tbps=3.35, memory_gib=80.0, nvlink_gbps=900.0),
        GpuSpec("h800", bf16_tflops=989.0, mem_bw_tbps=3.35, memory_gib=80.0, nvlink_gbps=400.0),
        GpuSpec("h20", bf16_tflops=148.0, mem_bw_tbps=4.0, memory_gib=96.0, nvlink_gbps=900.0),
        GpuSpec("h200", bf16_tflops=989.0, mem_bw_tbps=4.8, memory_gib=141.0, nvlink_gbps=900.0),
        GpuSpec(
            "a100",
            bf16_tflops=312.0,
            mem_bw_tbps=2.0,
            memory_gib=80.0,
            nvlink_gbps=600.0,
            host_link_gbps=12.5,
        ),
    )
}


@dataclass(frozen=True)
class ModelConfig:
    """A dense decoder-only transformer with grouped-query attention and a gated MLP (Qwen3, Llama-2)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    head_dim: int = 128
    vocab: int = 151936
    tie_embeddings: bool = False
    qk_norm: bool = True

    @property
    def attn_params(self) -> int:
        """Per layer: q, k, v and o projections (Qwen3 has no qkv bias)."""
        return (
            self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
            + self.heads * self.head_dim * self.hidden
        )

    @property
    def mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    @property
    def layer_params(self) -> int:
        # Two RMSNorms over hidden plus Qwen3's q/k norms over head_dim.
        return self.attn_params + self.mlp_params + 2 * self.hidden + 2 * self.head_dim * self.qk_norm

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        embeddings = self.embedding_params * (1 if self.tie_embeddings else 2)
        return self.layers * self.layer_params + self.hidden + embeddings

    @property
    def weight_bytes(self) -> int:
        return self.params * _BF16

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * _BF16

    @property
    def weight_bytes_read(self) -> int:
        """Bytes one forward pass streams from memory: an untied input embedding is only gathered by row."""
        return self.weight_bytes - (0 if self.tie_embeddings else self.embedding_params * _BF16)


MODELS: dict[str, ModelConfig] = {
    m.name: m
    for m in (
        ModelConfig(
            "qwen3-0.6b", layers=28, hidden=1024, heads=16, kv_heads=8, intermediate=3072, tie_embeddings=True
        ),
        ModelConfig("qwen3-8b", layers=36, hidden=4096, heads=32, kv_heads=8, intermediate=12288),
        ModelConfig("qwen3-14b", layers=40, hidden=5120, heads=40, kv_heads=8, intermediate=17408),
        ModelConfig("qwen3-32b", layers=64, hidden=5120, heads=64, kv_heads=8, intermediate=25600),
        # Vidur's profiled model, kept for calibration.
        ModelConfig(
            "llama-2-7b",
            layers=32,
            hidden=4096,
            heads=32,
            kv_heads=32,
            intermediate=11008,
            vocab=32000,
            qk_norm=False,
        ),
    )
}


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of datasheet peaks, and fixed costs, for one GPU kind."""

    compute: float = 0.701
    memory: float = 0.698
    # Fraction of the shorter of compute and memory time that the longer does not hide: kernels do not
    # overlap the two perfectly, which is what makes the knee of the roofline round.
    exposed: float = 0.397
    overhead_s: float = 0.0005  # scheduling, kernel launches and sampling per iteration
    link: float = 0.75
    allreduce_latency_s: float = 10e-6


# Fitted by ``loom.bench.engine_calibration.fit`` (least squares of relative error, rounded; a test checks that a
# refit agrees). Default: compute, memory and exposed from Vidur's H100 profile of Llama-2-7B. H20: memory and
# overhead from Qwen's SGLang decode speeds at batch 1 (Qwen3-8B 81.7, 14B 47.1, 32B 20.7 tok/s); its few SMs
# keep small-batch GEMVs far from peak bandwidth. Overhead, link efficiency and all-reduce latency of the
# other GPUs are priors: no published point constrains them.
EFFICIENCY: dict[str, Efficiency] = {
    "h20": Efficiency(memory=0.344, overhead_s=0.001),
}


def gpu_spec(name: str) -> GpuSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}") from None


def model_config(name: str) -> ModelConfig:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


class PerfModel:
    def __init__(
        self,
        gpu: GpuSpec | str,
        model: ModelConfig | str,
        tp: int = 1,
        efficiency: Efficiency | None = None,
        activation_reserve_gib: float = 1.0,
    ) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        self.gpu = gpu_spec(gpu) if isinstance(gpu, str) else gpu
        self.model = model_config(model) if isinstance(model, str) else model
        self.tp = tp
        self.efficiency = efficiency or EFFICIENCY.get(self.gpu.name, Efficiency())
        self.activation_reserve_gib = activation_reserve_gib
        m, eff = self.model, self.efficiency
        # KV heads are split across ranks; beyond kv_heads ranks they are replicated.
        self._kv_shards = min(tp, m.kv_heads)
        flops_rate = self.gpu.bf16_tflops * 1e12 * eff.compute * tp
        byte_rate = self.gpu.mem_bw_tbps * 1e12 * eff.memory
        # NVLink's datasheet figure counts both directions.
        self._link_rate = self.gpu.nvlink_gbps * 1e9 / 2 * eff.link
        self._s_per_token = 2 * m.layers * (m.attn_params + m.mlp_params) / flops_rate
        self._s_per_logit_row = 2 * m.embedding_params / flops_rate
        # QK^T and PV: 2 FLOPs each per (query, key, head, head_dim element).
        self._s_per_attn_pair = 4 * m.layers * m.heads * m.head_dim / flops_rate
        self._weights_s = m.weight_bytes_read / tp / byte_rate
        self._layer_weights_s = m.layers * (m.attn_params + m.mlp_params) * _BF16 / tp / byte_rate
        self._s_per_kv_token = m.kv_bytes_per_token / self._kv_shards / byte_rate
        if tp > 1:
            # Two ring all-reduces of the hidden state per layer.
            n_allreduce = 2 * m.layers
            self._comm_s = n_allreduce * eff.allreduce_latency_s
            self._comm_s_per_token = n_allreduce * 2 * (tp - 1) / tp * m.hidden * _BF16 / self._link_rate
        else:
            self._comm_s = self._comm_s_per_token = 0.0

    def iteration_time(
        self,
        prefill_tokens: float,
        decode_seqs: float,
        decode_kv_tokens: float,
        prefill_attended: float | None = None,
    ) -> float:
        """Seconds for one iteration that prefills ``prefill_tokens`` and decodes one token for each of
        ``decode_seqs`` sequences holding ``decode_kv_tokens`` of context in total.

        ``prefill_attended`` is the number of (query, key) pairs the prefill attends over; by default the
        chunk is taken as one fresh causal sequence.
        """
        if prefill_attended is None:
            prefill_attended = prefill_tokens * (prefill_tokens + 1) / 2
        tokens = prefill_tokens + decode_seqs
        compute = (
            tokens * self._s_per_token
            + decode_seqs * self._s_per_logit_row
            + (prefill_attended + decode_kv_tokens) * self._s_per_attn_pair
        )
        memory = self._weights_s + decode_kv_tokens * self._s_per_kv_token
        comm = self._comm_s + tokens * self._comm_s_per_token if self.tp > 1 else 0.0
        return self.efficiency.overhead_s + self._roofline(compute, memory) + comm

    def verify_time(self, decode_seqs: float, decode_kv_tokens: float, positions: float) -> float:
        """Seconds for one speculative verification step: each of ``decode_seqs`` sequences (``decode_kv_tokens``
        of context in all) feeds ``positions`` tokens, its last one and its draft, and gets logits at every
        one: a plain decode iteration plus ``_verify_extra``. One position is a plain decode iteration."""
        return self.iteration_time(0, decode_seqs, decode_kv_tokens) + self._verify_extra(
            decode_seqs, decode_kv_tokens, positions
        )

    def _verify_extra(self, decode_seqs: float, decode_kv_tokens: float, positions: float) -> float:
        """What the drafted positions add to a decode iteration, priced per kernel: the weight GEMMs' roofline
        and attention's roofline each grow on their own, since one kernel's spare compute cannot hide
        another's memory time. (The single roofline of ``iteration_time`` lets the extra positions hide under
        the cache read: it put 8 positions at batch 128 on an H200 at 1.25x a decode step where 1.51x was
        measured from 2 positions on; this form gives 1.58x, measured/README.md.) Linear in the context,
        with a slope that does not change sign, so that ``decode_span`` sums it in closed form."""
        if positions <= 1.0:
            return 0.0
        d = decode_seqs
        row = self._s_per_token + self._s_per_logit_row
        linear = self._roofline(d * positions * row, self._weights_s) - self._roofline(
            d * row, self._weights_s
        )
        comm = d * (positions - 1) * self._comm_s_per_token
        return linear + comm + decode_kv_tokens * self._attention_growth(positions)

    def _attention_growth(self, positions: float) -> float:
        """Seconds per token of context that attention adds for ``positions`` query positions over one (the
        roofline is homogeneous: both its terms scale with the context)."""
        a, m = self._s_per_attn_pair, self._s_per_kv_token
        return self._roofline(positions * a, m) - self._roofline(a, m)

    def decode_span(
        self, decode_seqs: int, decode_kv_tokens: int, iterations: int, positions: float = 1.0
    ) -> float:
        """Seconds for ``iterations`` pure decode iterations of ``decode_seqs`` sequences whose context grows
        by one token each per iteration, starting from ``decode_kv_tokens``: the exact sum of ``verify_time``
        over them (``iteration_time`` at one position), in O(1), so that a simulator can jump over them."""
        if iterations <= 0:
            return 0.0
        d, n = decode_seqs, iterations
        # Compute time a + b*i and memory time p + q*i at iteration i; both are linear in the context.
        a = d * (self._s_per_token + self._s_per_logit_row) + decode_kv_tokens * self._s_per_attn_pair
        b = d * self._s_per_attn_pair
        p = self._weights_s + decode_kv_tokens * self._s_per_kv_token
        q = d * self._s_per_kv_token
        fixed = self.efficiency.overhead_s + (
            self._comm_s + d * self._comm_s_per_token if self.tp > 1 else 0.0
        )
        if b == q:
            split = 0 if a >= p else n
        elif b > q:  # compute-bound from the crossing on
            split = min(n, max(0, math.ceil((p - a) / (b - q))))
        else:
            split = min(n, max(0, math.floor((p - a) / (b - q)) + 1))
        if b >= q:
            larger = _arith(p, q, 0, split) + _arith(a, b, split, n)
        else:
            larger = _arith(a, b, 0, split) + _arith(p, q, split, n)
        # max + e * min = (1 - e) * max + e * (compute + memory)
        both = _arith(a + p, b + q, 0, n)
        exposed = self.efficiency.exposed
        plain = n * fixed + (1 - exposed) * larger + exposed * both
        if positions <= 1.0:
            return plain
        extra_at_start = self._verify_extra(d, decode_kv_tokens, positions)
        return plain + _arith(extra_at_start, d * self._attention_growth(positions), 0, n)

    def per_token_time(self, batch: int, context_len: int) -> float:
        """Seconds between two tokens of one sequence decoding in a batch of ``batch`` sequences that each
        hold ``context_len`` tokens: Heddle's per-token time, T at batch 1."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        return self.iteration_time(0, batch, batch * context_len)

    def interference(self, batch: int, context_len: int) -> float:
        """Heddle's interference factor of a batch: its per-token time over the batch-1 per-token time."""
        return self.per_token_time(batch, context_len) / self.per_token_time(1, context_len)

    def linear_layers_time(self, tokens: int) -> float:
        """Seconds for the weight GEMMs of the transformer layers over ``tokens`` tokens, without attention,
        LM head, all-reduces and overhead: what Vidur profiles as an iteration's non-attention time."""
        return self._roofline(tokens * self._s_per_token, self._layer_weights_s)

    def kv_transfer_time(self, tokens: int, bandwidth_gbps: float | None = None) -> float:
        """Seconds to move ``tokens`` of KV cache to another engine, each rank sending its shard over its own
        link of ``bandwidth_gbps`` GB/s (default: one direction of this GPU's NVLink, at link efficiency)."""
        rate = self._link_rate if bandwidth_gbps is None else bandwidth_gbps * 1e9
        if rate <= 0:
            raise ValueError(f"bandwidth must be positive, got {bandwidth_gbps}")
        return tokens * self.model.kv_bytes_per_token / self._kv_shards / rate

    def kv_capacity_tokens(self, mem_fraction: float = 0.9) -> int:
        """KV-cache tokens that fit beside the weights and activations (SGLang's ``mem_fraction_static``)."""
        budget = self.gpu.memory_gib * _GIB * self.tp * mem_fraction
        reserve = self.activation_reserve_gib * _GIB * self.tp
        per_token = self.model.kv_bytes_per_token * self.tp / self._kv_shards
        return max(0, int((budget - self.model.weight_bytes - reserve) // per_token))

    def _roofline(self, compute: float, memory: float) -> float:
        return max(compute, memory) + self.efficiency.exposed * min(compute, memory)


def _arith(a: float, b: float, lo: int, hi: int) -> float:
    """Sum of a + b*i over lo <= i < hi."""
    if hi <= lo:
        return 0.0
    return (hi - lo) * a + b * (lo + hi - 1) * (hi - lo) / 2
