"""The GPU iteration profiler's Qwen3 forward pass, and its grid, on the CPU."""

from __future__ import annotations

import torch

from loom.bench import iteration_profile as ip
from loom.engine.model.perf import ModelConfig

TINY = ModelConfig("tiny", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, head_dim=16, vocab=211)


def test_forward_pass_is_transformers_qwen3() -> None:
    """Same weights, same next-token logits as transformers' Qwen3 for a prefill and the decode after it: the
    measured table times Qwen3, not something shaped like it."""
    assert ip.check_against_transformers("cpu") < 1e-4


def test_decode_continues_a_prefill_as_one_longer_prefill() -> None:
    torch.manual_seed(1)
    w = ip.random_weights(TINY, "cpu", torch.float32)
    ids = torch.randint(0, TINY.vocab, (3, 12))
    with torch.no_grad():
        whole = ip.Runner(w, 3, 12).hidden(ids, 0)
        run = ip.Runner(w, 3, 12)
        run.hidden(ids[:, :11], 0)
        stepped = run.hidden(ids[:, 11:], 11)
    assert torch.allclose(whole, stepped, atol=1e-5)


def test_grid_times_what_fits_and_names_what_does_not() -> None:
    kv_token = 2 * TINY.layers * TINY.kv_heads * TINY.head_dim * 4
    with torch.no_grad():
        r = ip.profile_model(
            TINY,
            "cpu",
            batches=(1, 4),
            contexts=(32, 128),
            prompts=(16, 256),
            memory_bytes=4 * 129 * kv_token - 1,
            grids=("decode", "prefill"),
        )
    assert [(d["batch"], d["context"]) for d in r["decode"]] == [(1, 32), (4, 32), (1, 128)]
    assert [p["tokens"] for p in r["prefill"]] == [16, 256]
    assert r["skipped"] == [{"batch": 4, "context": 128, "kv_gib": 4 * 129 * kv_token / 1024**3}]
    assert all(d["median_s"] > 0 and d["reps"] >= 5 for d in r["decode"] + r["prefill"])


def test_a_verification_step_sees_what_decoding_the_draft_one_token_at_a_time_sees() -> None:
    torch.manual_seed(2)
    w = ip.random_weights(TINY, "cpu", torch.float32)
    ids = torch.randint(0, TINY.vocab, (2, 13))
    with torch.no_grad():
        whole = ip.Runner(w, 2, 13).states(ids, 0)
        run = ip.Runner(w, 2, 13)
        run.states(ids[:, :9], 0)
        drafted = run.states(ids[:, 9:], 9)
        picks = run.verify(ids[:, 9:], 9)
    assert torch.allclose(whole[:, 9:], drafted, atol=1e-5)
    assert torch.equal(picks, run.logits(whole[:, 9:]).argmax(-1))
