"""Measure one engine iteration of a Qwen3 model on a GPU: decode time against batch and context, prefill time
against prompt length, with random weights.

The forward pass is Qwen3's, written in plain torch so that nothing but torch is needed on the GPU machine
(``tests/unit/test_iteration_profile.py`` checks its logits against transformers' Qwen3 on the same weights).
It is laid out as an engine lays it out: fused QKV and gate-up projections, a preallocated KV cache, logits
for the last position only, a greedy pick of the next token, and each iteration captured in a CUDA graph so
that kernel launches cost what they cost under SGLang's or vLLM's graphs. What it leaves out, it leaves out
on the slow side: elementwise steps are not fused and attention is torch's SDPA over a contiguous cache, not
a paged decode kernel. Tensor parallelism needs several GPUs and is not measured.

    PYTHONPATH=libs python3 -m loom.bench.iteration_profile --out FILE
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from loom.engine.model.perf import MODELS, ModelConfig

EPS = 1e-6
ROPE_THETA = 1_000_000.0  # Qwen3's
MODEL_NAMES = ("qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen3-0.6b")
BATCHES = (1, 8, 32, 64, 128, 256)
CONTEXTS = (1024, 4096, 16384, 32768)
PROMPTS = (128, 512, 2048, 8192, 16384)
# Speculative verification: positions per sequence (its last token and a draft of positions - 1).
VERIFY_BATCHES = (1, 8, 32, 64, 128)
VERIFY_CONTEXT = 4096
VERIFY_POSITIONS = (1, 2, 4, 8)
GRIDS = ("decode", "prefill", "verify")
_HEADROOM = 8 * 1024**3  # activations, logits and the graph's pool beside weights and cache


@dataclass
class Layer:
    ln1: Any
    qkv: Any  # (heads + 2 kv_heads) * head_dim x hidden: q, k, v stacked as an engine fuses them
    q_norm: Any
    k_norm: Any
    o: Any
    ln2: Any
    gate_up: Any  # 2 intermediate x hidden: gate then up
    down: Any


@dataclass
class Weights:
    cfg: ModelConfig
    embed: Any
    layers: list[Layer]
    norm: Any
    lm_head: Any
    rope_theta: float = ROPE_THETA


def random_weights(cfg: ModelConfig, device: str, dtype: Any, seed: int = 0) -> Weights:
    import torch

    g = torch.Generator(device=device).manual_seed(seed)

    def w(*shape: int) -> Any:
        return (torch.randn(*shape, generator=g, device=device, dtype=dtype) * 0.02).contiguous()

    def ones(n: int) -> Any:
        return torch.ones(n, device=device, dtype=dtype)

    h, d = cfg.hidden, cfg.head_dim
    layers = [
        Layer(
            ln1=ones(h),
            qkv=w((cfg.heads + 2 * cfg.kv_heads) * d, h),
            q_norm=ones(d),
            k_norm=ones(d),
            o=w(h, cfg.heads * d),
            ln2=ones(h),
            gate_up=w(2 * cfg.intermediate, h),
            down=w(h, cfg.intermediate),
        )
        for _ in range(cfg.layers)
    ]
    embed = w(cfg.vocab, h)
    return Weights(cfg, embed, layers, ones(h), embed if cfg.tie_embeddings else w(cfg.vocab, h))


def from_hf(model: Any) -> Weights:
    """The weights of a transformers Qwen3ForCausalLM, fused as this module runs them."""
    import torch

    c = model.config
    cfg = ModelConfig(
        "hf",
        layers=c.num_hidden_layers,
        hidden=c.hidden_size,
        heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads,
        intermediate=c.intermediate_size,
        head_dim=c.head_dim,
        vocab=c.vocab_size,
        tie_embeddings=c.tie_word_embeddings,
    )
    layers = []
    for lay in model.model.layers:
        a, m = lay.self_attn, lay.mlp
        layers.append(
            Layer(
                ln1=lay.input_layernorm.weight,
                qkv=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                q_norm=a.q_norm.weight,
                k_norm=a.k_norm.weight,
                o=a.o_proj.weight,
                ln2=lay.post_attention_layernorm.weight,
                gate_up=torch.cat([m.gate_proj.weight, m.up_proj.weight]),
                down=m.down_proj.weight,
            )
        )
    rope = getattr(c, "rope_parameters", None) or {"rope_theta": c.rope_theta}  # transformers 5 or 4
    theta = float(rope["rope_theta"])
    return Weights(
        cfg, model.model.embed_tokens.weight, layers, model.model.norm.weight, model.lm_head.weight, theta
    )


def _rms(x: Any, w: Any) -> Any:
    import torch

    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _rope(w: Weights, positions: Any, dtype: Any) -> tuple[Any, Any]:
    import torch

    d = w.cfg.head_dim
    inv = 1.0 / (w.rope_theta ** (torch.arange(0, d, 2, device=positions.device, dtype=torch.float32) / d))
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: Any, cos: Any, sin: Any) -> Any:
    import torch

    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Runner:
    """One model's forward pass over a KV cache of ``batch`` sequences of room ``room`` tokens each."""

    def __init__(self, w: Weights, batch: int, room: int) -> None:
        import torch

        self.w = w
        cfg = w.cfg
        dev, dtype = w.embed.device, w.embed.dtype
        shape = (batch, cfg.kv_heads, room, cfg.head_dim)
        # Random, not zeros: kernels can run faster on zeros than on data.
        self.k = [torch.randn(shape, device=dev, dtype=dtype) for _ in range(cfg.layers)]
        self.v = [torch.randn(shape, device=dev, dtype=dtype) for _ in range(cfg.layers)]

    def step(self, ids: Any, start: int) -> Any:
        """One iteration: the next token of each row, picked greedily."""
        return self.logits(self.hidden(ids, start)).argmax(-1)

    def verify(self, ids: Any, start: int) -> Any:
        """One speculative verification step: ``ids`` holds each row's last token and its draft; the model's
        own token after every position, as an engine needs to accept or reject each drafted token."""
        return self.logits(self.states(ids, start)).argmax(-1)

    def hidden(self, ids: Any, start: int) -> Any:
        """Each row's last hidden state after ``states``."""
        return self.states(ids, start)[:, -1]

    def states(self, ids: Any, start: int) -> Any:
        """Run ``ids`` (batch x tokens) at positions ``start``.. over the cache; every position's final hidden
        state.

        With one token per row this is a decode step attending to the ``start`` tokens before it; with
        several, each attends to the cache and causally within the row's new tokens (a prefill from 0, or a
        verification of a draft)."""
        import torch
        import torch.nn.functional as F

        w, cfg = self.w, self.w.cfg
        b, t = ids.shape
        nh, nkv, d = cfg.heads, cfg.kv_heads, cfg.head_dim
        positions = torch.arange(start, start + t, device=ids.device)
        cos, sin = _rope(w, positions, w.embed.dtype)
        x = F.embedding(ids, w.embed)
        for i, lay in enumerate(w.layers):
            h = _rms(x, lay.ln1)
            q, k, v = F.linear(h, lay.qkv).split([nh * d, nkv * d, nkv * d], dim=-1)
            q = _rotate(_rms(q.view(b, t, nh, d), lay.q_norm).transpose(1, 2), cos, sin)
            k = _rotate(_rms(k.view(b, t, nkv, d), lay.k_norm).transpose(1, 2), cos, sin)
            self.k[i][:, :, start : start + t] = k
            self.v[i][:, :, start : start + t] = v.view(b, t, nkv, d).transpose(1, 2)
            keys, values = self.k[i][:, :, : start + t], self.v[i][:, :, : start + t]
            if start == 0:
                a = _attend(q, keys, values, causal=True)
            else:
                # A query head h reads KV head h // G. The G heads of a group attend as G x t queries of one
                # KV head, so that each KV head's cache is read once, as engines' decode kernels read it.
                a = _attend_grouped(q.reshape(b, nkv, (nh // nkv) * t, d), keys, values, t)
            x = x + F.linear(a.reshape(b, nh, t, d).transpose(1, 2).reshape(b, t, nh * d), lay.o)
            gate, up = F.linear(_rms(x, lay.ln2), lay.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, lay.down)
        return x

    def logits(self, last: Any) -> Any:
        import torch.nn.functional as F

        return F.linear(_rms(last, self.w.norm), self.w.lm_head)


def _attend(q: Any, k: Any, v: Any, causal: bool) -> Any:
    """SDPA held to FlashAttention on CUDA: were it to fall back to the math kernel unasked, a 16k-token
    prefill would build its whole score matrix and the table would time that instead."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gqa = q.shape[1] != k.shape[1]
    if q.device.type != "cuda" or q.dtype == torch.float32:  # FlashAttention has no float32 kernel
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)


def _attend_grouped(q: Any, k: Any, v: Any, t: int) -> Any:
    """Attention of a group's queries (G heads x ``t`` new positions, head-major) over a cache whose last
    ``t`` keys are those positions: each sees the cache and the new positions up to its own. One position
    needs no mask and runs on FlashAttention; several need this mask, which FlashAttention cannot take, and
    run on the memory-efficient kernel (CUDA) that takes one."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if t == 1:
        return _attend(q, k, v, causal=False)
    rows, keys = q.shape[2], k.shape[2]
    own = torch.arange(rows, device=q.device) % t + (keys - t)
    mask = torch.arange(keys, device=q.device)[None, :] <= own[:, None]
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def time_call(
    fn: Callable[[], Any], budget_s: float = 0.5, reps: tuple[int, int] = (5, 20)
) -> dict[str, float]:
    """Median seconds of ``fn``: on CUDA each call a replay of a captured graph timed by device events, on the
    CPU a plain call timed by the clock. Repetitions fill ``budget_s``, within ``reps``."""
    import torch

    if not torch.cuda.is_available():
        fn()
        runs = []
        for _ in range(reps[0]):
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        return {"median_s": statistics.median(runs), "min_s": min(runs), "reps": len(runs)}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    n = max(reps[0], min(reps[1], int(budget_s / max(time.perf_counter() - t0, 1e-6))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    runs = [s.elapsed_time(e) / 1e3 for s, e in events]
    del graph
    return {"median_s": statistics.median(runs), "min_s": min(runs), "reps": n}


def profile_model(
    cfg: ModelConfig,
    device: str,
    batches: Sequence[int] = BATCHES,
    contexts: Sequence[int] = CONTEXTS,
    prompts: Sequence[int] = PROMPTS,
    memory_bytes: int | None = None,
    grids: Sequence[str] = GRIDS,
) -> dict[str, Any]:
    """Decode iterations for every batch x context whose cache fits, fresh prefills of every prompt length,
    and verification steps of drafts at ``VERIFY_CONTEXT`` tokens of context, for one model with random
    bf16 weights (float32 on the CPU)."""
    import torch

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    w = random_weights(cfg, device, dtype)
    free = memory_bytes if memory_bytes is not None else _free_bytes(device)
    kv_token = cfg.kv_bytes_per_token * dtype.itemsize // 2  # the config counts bf16
    decode: list[dict[str, Any]] = []
    prefill: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for ctx in contexts if "decode" in grids else ():
        for b in batches:
            if b * (ctx + 1) * kv_token > free:
                skipped.append({"batch": b, "context": ctx, "kv_gib": b * (ctx + 1) * kv_token / 1024**3})
                continue
            point = {"batch": b, "context": ctx}
            ids = torch.randint(0, cfg.vocab, (b, 1), device=device)
            timed = _timed(w, b, ctx + 1, functools.partial(Runner.step, ids=ids, start=ctx))
            (decode if "median_s" in timed else skipped).append({**point, **timed})
    for n in prompts if "prefill" in grids else ():
        if n * kv_token > free:
            skipped.append({"prompt": n})
            continue
        ids = torch.randint(0, cfg.vocab, (1, n), device=device)
        timed = _timed(w, 1, n, functools.partial(Runner.step, ids=ids, start=0))
        (prefill if "median_s" in timed else skipped).append({"tokens": n, **timed})
    verify: list[dict[str, Any]] = []
    for b in VERIFY_BATCHES if "verify" in grids else ():
        for t in VERIFY_POSITIONS:
            point = {"batch": b, "context": VERIFY_CONTEXT, "positions": t}
            if b * (VERIFY_CONTEXT + t) * kv_token > free:
                skipped.append(point)
                continue
            ids = torch.randint(0, cfg.vocab, (b, t), device=device)
            fn = Runner.step if t == 1 else Runner.verify
            timed = _timed(w, b, VERIFY_CONTEXT + t, functools.partial(fn, ids=ids, start=VERIFY_CONTEXT))
            (verify if "median_s" in timed else skipped).append({**point, **timed})
    del w
    _release(device)
    return {"model": cfg.name, "decode": decode, "prefill": prefill, "verify": verify, "skipped": skipped}


def _timed(w: Weights, batch: int, room: int, step: Callable[[Runner], Any]) -> dict[str, Any]:
    import torch

    try:
        return _time_runner(Runner(w, batch, room), step)
    except torch.OutOfMemoryError as e:
        return {"error": f"out of memory: {str(e).splitlines()[0]}"}
    finally:
        # The runner's cache is unreferenced once _time_runner's frame is gone.
        _release(w.embed.device.type)


def _time_runner(run: Runner, step: Callable[[Runner], Any]) -> dict[str, float]:
    return time_call(lambda: step(run))


def check_against_transformers(device: str) -> float:
    """Largest absolute difference between this module's next-token logits and transformers' Qwen3 on the
    same small random model, float32, for a prefill and the decode step after it."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    c = Qwen3Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=EPS,
        tie_word_embeddings=False,
    )
    hf = AutoModelForCausalLM.from_config(c).to(device).float().eval()
    w = from_hf(hf)
    ids = torch.randint(0, c.vocab_size, (2, 9), device=device)
    run = Runner(w, 2, 9)
    worst = 0.0
    with torch.no_grad():
        for t in (8, 9):
            ref = hf(ids[:, :t]).logits[:, -1]
            x = run.hidden(ids[:, :8], 0) if t == 8 else run.hidden(ids[:, 8:9], 8)
            worst = max(worst, (run.logits(x) - ref).abs().max().item())
    return worst


def ceilings(device: str) -> dict[str, float]:
    """The device's copy bandwidth (bytes read plus written) and bf16 matrix rate, on random data."""
    import torch

    if not device.startswith("cuda"):
        return {}
    src = torch.randn(1024**3, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy = time_call(lambda: dst.copy_(src))["median_s"]
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    mm = time_call(lambda: a @ b)["median_s"]
    t0 = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize()
    eager = (time.perf_counter() - t0) / 20
    return {
        "copy_tb_s": 4 * 1024**3 / copy / 1e12,
        "copy_tb_s_eager": 4 * 1024**3 / eager / 1e12,
        "bf16_tflops": 2 * 8192**3 / mm / 1e12,
    }


def _free_bytes(device: str) -> int:
    import torch

    if device.startswith("cuda"):
        return max(0, torch.cuda.mem_get_info()[0] - _HEADROOM)
    return 2 * 1024**3


def _release(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--models", default=",".join(MODEL_NAMES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--grids", default=",".join(GRIDS), help="which of decode, prefill, verify to measure")
    a = p.parse_args(argv)
    import torch

    torch.set_grad_enabled(False)
    result: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
        "check_max_abs_logit_diff": _checked(a.device),
        "ceilings": ceilings(a.device),
        "models": [],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "models"}), flush=True)
    for name in a.models.split(","):
        if name == "ceilings":  # again, once the clocks have risen
            result["ceilings_after"] = ceilings(a.device)
            print(json.dumps(result["ceilings_after"]), flush=True)
        else:
            t0 = time.perf_counter()
            r = profile_model(MODELS[name], a.device, grids=a.grids.split(","))
            r["wall_s"] = time.perf_counter() - t0
            result["models"].append(r)
            _print(r)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


def _checked(device: str) -> float | str:
    try:
        return check_against_transformers(device)
    except Exception as e:  # the timings are still worth having; the JSON says why the check is missing
        return f"{type(e).__name__}: {e}"


def _print(r: dict[str, Any]) -> None:
    print(f"{r['model']} ({r['wall_s']:.0f} s)", flush=True)
    for d in r["decode"]:
        print(f"  decode b={d['batch']:>3} ctx={d['context']:>5}  {d['median_s'] * 1e3:8.2f} ms", flush=True)
    for q in r["prefill"]:
        print(f"  prefill {q['tokens']:>5} tokens  {q['median_s'] * 1e3:8.2f} ms", flush=True)
    for v in r["verify"]:
        print(
            f"  verify b={v['batch']:>3} positions={v['positions']}  {v['median_s'] * 1e3:8.2f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
