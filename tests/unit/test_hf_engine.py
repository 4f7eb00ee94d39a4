"""The transformers engine on tiny Qwen3 checkpoints: batching is exact, log-probs are right, control works."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from loom import checkpoints as policy
from loom.engine.base import EngineOutput, EngineRequest
from loom.engine.clients.hf import HFEngine
from loom.engine.clients.hf_batch import Seq, request_generator, sample
from loom.text.tokenizer import STOP_IDS
from loom.weights import Incoming

SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "head_dim": 16}
PROMPTS = [[(37 * i + 101 * j) % 5000 + 10 for j in range(n)] for i, n in enumerate([5, 17, 30, 11])]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, PreTrainedModel]]]:
    """Checkpoints, each beside its model: two seeds of the same shape, one whose vocabulary differs, and one
    that always says <|endoftext|> first."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference forwards here; the engines run on their own threads
    root = tmp_path_factory.mktemp("hf")
    built = {
        "a": policy.build_tiny(seed=0, **SMALL),
        "b": policy.build_tiny(seed=1, **SMALL),
        "vocab": policy.build_tiny(seed=0, **{**SMALL, "vocab_size": 151_936}),
        "stop": _always_stops(),
    }
    yield {name: (policy.save(m, root / name), m) for name, m in built.items()}
    torch.set_num_threads(threads)


def _always_stops() -> PreTrainedModel:
    # A large constant coordinate in every embedding dominates the final RMSNorm, and an untied head reads only
    # that coordinate for STOP_IDS[0]: its logit is far above every other, whatever the context.
    model = policy.build_tiny(seed=2, tie_word_embeddings=False, **SMALL)
    with torch.no_grad():
        embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
        assert isinstance(embeddings, torch.nn.Embedding) and isinstance(head, torch.nn.Linear)
        embeddings.weight[:, 0] = 10.0
        head.weight[STOP_IDS[0]] = 0.0
        head.weight[STOP_IDS[0], 0] = 10.0
    return model


@pytest.fixture
async def engine_at(models: dict) -> AsyncIterator[Callable[..., Awaitable[HFEngine]]]:
    """Starts engines on the named checkpoint; closes them after the test."""
    started: list[HFEngine] = []

    async def make(name: str = "a", **kw: object) -> HFEngine:
        engine = HFEngine(str(models[name][0]), **kw)  # type: ignore[arg-type]
        await engine.start()
        started.append(engine)
        return engine

    yield make
    for engine in started:
        await engine.close()


def req(rid: str, prompt: list[int], n: int, **kw: object) -> EngineRequest:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("ignore_eos", True)
    kw.setdefault("return_logprob", True)
    return EngineRequest(rid=rid, input_len=len(prompt), max_new_tokens=n, input_ids=prompt, **kw)  # type: ignore[arg-type]


def full_logits(model: PreTrainedModel, prompt: list[int], out: list[int]) -> torch.Tensor:
    """Logits predicting each output token, from one forward over the whole sequence (no KV cache)."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1]


def greedy(model: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1].argmax()))
    return ids[len(prompt) :]


async def until(cond: Callable[[], bool], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


async def test_batched_equals_unbatched_and_the_full_forward(engine_at, models) -> None:
    engine = await engine_at()
    lengths = [12, 20, 8, 25]
    alone = [
        await engine.generate(req(f"alone{i}", p, n))
        for i, (p, n) in enumerate(zip(PROMPTS, lengths, strict=True))
    ]
    # Two start together; two more join while those decode, at other lengths (the batch pads them).
    first = [asyncio.create_task(engine.generate(req(f"b{i}", PROMPTS[i], lengths[i]))) for i in (0, 1)]
    await until(lambda: engine.load().generated_tokens >= sum(lengths) + 6)
    later = [asyncio.create_task(engine.generate(req(f"b{i}", PROMPTS[i], lengths[i]))) for i in (2, 3)]
    batched = await asyncio.gather(*first, *later)

    model = models["a"][1]
    for prompt, n, a, b in zip(PROMPTS, lengths, alone, batched, strict=True):
        assert a.finish_reason == b.finish_reason == "length"
        assert a.output_ids == b.output_ids and len(a.output_ids) == n
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-4)
        logps = torch.log_softmax(full_logits(model, prompt, a.output_ids), dim=-1)
        assert logps.argmax(-1).tolist() == a.output_ids
        ref = logps[torch.arange(n), torch.tensor(a.output_ids)].tolist()
        assert a.output_logprobs == pytest.approx(ref, abs=1e-4)
        assert b.weight_version == "0" and b.queue_s >= 0 and b.prefill_s > 0 and b.decode_s > 0
    load = engine.load()
    assert (load.running, load.waiting, load.kv_used_tokens) == (0, 0, 0)
    assert load.generated_tokens == 2 * sum(lengths)


async def test_sampled_logprobs_follow_the_scaled_distribution(engine_at, models) -> None:
    engine = await engine_at()
    outs = await asyncio.gather(
        engine.generate(req("t", PROMPTS[1], 16, temperature=0.7)),
        engine.generate(req("p", PROMPTS[2], 16, temperature=0.7, top_p=0.5)),
    )
    model = models["a"][1]
    logps = []
    for prompt, out in zip(PROMPTS[1:3], outs, strict=True):
        assert out.output_ids is not None and out.output_logprobs is not None
        logps.append(torch.log_softmax(full_logits(model, prompt, out.output_ids) / 0.7, dim=-1))
        ref = logps[-1][torch.arange(16), torch.tensor(out.output_ids)].tolist()
        assert out.output_logprobs == pytest.approx(ref, abs=1e-4)
    # Nucleus: every top-p token lies in the smallest head of mass 0.5 (its logprob is still the full one).
    probs = logps[1].exp()
    for pos, token in enumerate(outs[1].output_ids or []):
        assert probs[pos][probs[pos] > probs[pos, token]].sum() < 0.5
    # A request samples from its own generator (engine seed + rid): batch-mates change nothing.
    again = await engine.generate(req("t", PROMPTS[1], 16, temperature=0.7))
    assert again.output_ids == outs[0].output_ids
    assert (await engine.generate(req("t2", PROMPTS[1], 16, temperature=0.7))).output_ids != again.output_ids


async def test_sampler_draws_from_the_distribution_and_its_nucleus() -> None:
    rows = 4000
    logits = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).log().expand(rows, -1)  # token 1 can never be drawn

    def freqs(top_p: float) -> list[float]:
        # One request per row, each with its own generator; sample() never touches the future.
        nowhere: asyncio.Future[EngineOutput] = asyncio.get_running_loop().create_future()
        r = req("x", [1], 1, temperature=1.0, top_p=top_p)
        seqs = [Seq(r, [1], i, nowhere, request_generator(0, f"x{i}"), 0.0) for i in range(rows)]
        picks = sample(logits, seqs)
        assert all(logprob == pytest.approx(float(logits[0, token]), abs=1e-6) for token, logprob in picks)
        return [sum(token == t for token, _ in picks) / rows for t in range(4)]

    assert freqs(1.0) == pytest.approx([0.1, 0.0, 0.6, 0.3], abs=0.03)
    assert freqs(0.65) == pytest.approx([0.0, 0.0, 2 / 3, 1 / 3], abs=0.03)


async def test_a_request_s_own_seed_draws_the_same_tokens_under_any_rid(engine_at) -> None:
    """SamplingParams.seeded: the same seed and prompt sample the same tokens whatever the rid (a rerun of a job
    names its requests by a new job id); another seed, or none, samples apart."""
    engine = await engine_at()

    async def draw(rid: str, seed: int | None) -> list[int] | None:
        return (await engine.generate(req(rid, PROMPTS[1], 24, temperature=1.0, seed=seed))).output_ids

    first, again = await asyncio.gather(draw("job-a.t0.0", 7), draw("job-b.t0.0", 7))
    assert first == again
    assert len({tuple(first or ()), tuple(await draw("job-a.t1.0", 8) or ())}) == 2
    assert (
        len({tuple(await draw("job-a.t0.0", None) or ()), tuple(await draw("job-b.t0.0", None) or ())}) == 2
    )


async def test_stop_token_and_length(engine_at) -> None:
    engine = await engine_at("stop")
    stop = await engine.generate(req("s", PROMPTS[0], 10, ignore_eos=False))
    assert stop.finish_reason == "stop"
    assert stop.output_ids == [STOP_IDS[0]] and stop.output_len == 1
    assert stop.output_logprobs is not None and -1e-3 < stop.output_logprobs[0] <= 0
    run_on = await engine.generate(req("l", PROMPTS[0], 10, ignore_eos=True))
    assert run_on.finish_reason == "length" and run_on.output_ids == [STOP_IDS[0]] * 10
    nothing = await engine.generate(req("z", PROMPTS[0], 0))
    assert (nothing.finish_reason, nothing.output_ids) == ("length", [])
    unlogged = await engine.generate(req("u", PROMPTS[0], 3, return_logprob=False))
    assert unlogged.output_logprobs is None and unlogged.output_len == 3


async def test_requests_the_engine_cannot_serve_raise_value_error(engine_at) -> None:
    engine = await engine_at(kv_capacity_tokens=1000)
    with pytest.raises(ValueError, match="input_ids"):
        await engine.generate(EngineRequest(rid="x", input_len=4, max_new_tokens=4))
    with pytest.raises(ValueError, match="limit"):
        await engine.generate(req("kv", PROMPTS[0], 1000))
    with pytest.raises(ValueError, match="token ids"):
        await engine.generate(req("v", [10**6], 4))
    big = await engine_at(kv_capacity_tokens=10**6)
    with pytest.raises(ValueError, match="max positions"):
        await big.generate(req("pos", PROMPTS[0], 2048))


async def test_abort_and_cancel(engine_at) -> None:
    engine = await engine_at()
    long = asyncio.create_task(engine.generate(req("long", PROMPTS[2], 1500)))
    short = asyncio.create_task(engine.generate(req("short", PROMPTS[1], 40)))
    await until(lambda: engine.load().generated_tokens >= 10)
    t0 = time.monotonic()
    assert await engine.abort("long")
    out = await long
    assert time.monotonic() - t0 < 0.5
    assert out.finish_reason == "abort" and 0 < out.output_len < 1500
    assert out.output_logprobs is not None and len(out.output_logprobs) == out.output_len
    assert (await short).finish_reason == "length"
    assert not await engine.abort("long")

    cancelled = asyncio.create_task(engine.generate(req("c", PROMPTS[0], 1500)))
    await until(lambda: engine.load().running == 1)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert (engine.load().running, engine.load().waiting) == (0, 0)
    # The engine goes on serving.
    assert (await engine.generate(req("after", PROMPTS[0], 3))).output_len == 3


async def test_pause_holds_and_resume_finishes(engine_at) -> None:
    engine = await engine_at()
    first = asyncio.create_task(engine.generate(req("r1", PROMPTS[1], 60)))
    await until(lambda: engine.load().generated_tokens >= 3)
    await engine.pause()
    second = asyncio.create_task(engine.generate(req("r2", PROMPTS[2], 10)))
    held = engine.load().generated_tokens
    await asyncio.sleep(0.3)
    load = engine.load()
    assert (load.generated_tokens, load.running, load.waiting) == (held, 1, 1)
    assert not first.done() and not second.done()
    await engine.resume()
    outs = await asyncio.gather(first, second)
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert [o.output_len for o in outs] == [60, 10]


async def test_two_phase_weight_update(engine_at, models) -> None:
    engine = await engine_at()
    prompt, n = PROMPTS[1], 40
    running = asyncio.create_task(engine.generate(req("w", prompt, n)))
    await until(lambda: engine.load().generated_tokens >= 8)
    await engine.pause()
    k = engine.load().generated_tokens  # tokens made by the old weights

    # A failed prepare changes nothing.
    with pytest.raises(FileNotFoundError):
        await engine.prepare_weights("1", Incoming.disk(str(models["a"][0].parent / "missing")))
    with pytest.raises(ValueError, match="vocab"):
        await engine.prepare_weights("1", Incoming.disk(str(models["vocab"][0])))
    with pytest.raises(ValueError, match="prepared"):
        await engine.commit_weights("1")
    assert engine.weight_version == "0"
    # Prepared and discarded: nothing to commit.
    await engine.prepare_weights("1", Incoming.disk(str(models["b"][0])))
    await engine.discard_weights("1")
    with pytest.raises(ValueError, match="prepared"):
        await engine.commit_weights("1")

    await engine.prepare_weights("1", Incoming.disk(str(models["b"][0])))
    await engine.commit_weights("1")
    await engine.resume()
    out = await running
    assert out.weight_version == engine.weight_version == "1"
    assert out.output_ids is not None and len(out.output_ids) == n
    assert out.output_ids[:k] == greedy(models["a"][1], prompt, k)
    assert out.output_ids[k:] == greedy(models["b"][1], prompt + out.output_ids[:k], n - k)
    assert out.output_ids[k:] != greedy(models["a"][1], prompt + out.output_ids[:k], n - k)
    # Later requests are served by the new weights alone.
    fresh = await engine.generate(req("f", PROMPTS[3], 6))
    assert fresh.output_ids == greedy(models["b"][1], PROMPTS[3], 6) and fresh.weight_version == "1"


async def test_higher_priority_is_admitted_first(engine_at) -> None:
    engine = await engine_at(max_running=1)
    await engine.pause()
    low = asyncio.create_task(engine.generate(req("low", PROMPTS[0], 6, priority=0.0)))
    high = asyncio.create_task(engine.generate(req("high", PROMPTS[1], 6, priority=5.0)))
    await until(lambda: engine.load().waiting == 2)
    await engine.resume()
    lo, hi = await asyncio.gather(low, high)
    assert hi.queue_s < lo.queue_s
    assert lo.queue_s >= hi.queue_s + hi.prefill_s + hi.decode_s - 0.01


async def test_close_aborts_everything(engine_at) -> None:
    engine = await engine_at()
    tasks = [asyncio.create_task(engine.generate(req(f"c{i}", PROMPTS[i], 1500))) for i in range(2)]
    await until(lambda: engine.load().generated_tokens >= 4)
    await engine.close()
    outs: list[EngineOutput] = await asyncio.gather(*tasks)
    assert [o.finish_reason for o in outs] == ["abort", "abort"]
    with pytest.raises(RuntimeError):
        await engine.generate(req("late", PROMPTS[0], 3))


def test_rollout_service_builds_it(models, monkeypatch: pytest.MonkeyPatch) -> None:
    from loom.runtime.service import Runtime
    from services.rollout.__main__ import make_engine
    from services.rollout.settings import RolloutSettings

    rt = Runtime("rollout", RolloutSettings())

    monkeypatch.setenv("LOOM_ROLLOUT_ENGINE", "hf")
    with pytest.raises(ValueError, match="MODEL_PATH"):
        make_engine(rt, RolloutSettings())
    monkeypatch.setenv("LOOM_ROLLOUT_MODEL_PATH", str(models["a"][0]))
    monkeypatch.setenv("LOOM_ROLLOUT_WEIGHT_VERSION", "7")
    engine = make_engine(rt, RolloutSettings(max_running=4))
    assert isinstance(engine, HFEngine) and engine.weight_version == "7"
    assert (engine.info.kind, engine.info.gpu, engine.info.max_running) == ("hf", "cpu", 4)
    assert engine.drafts is None
    monkeypatch.setenv("LOOM_ROLLOUT_SPECULATIVE", "1")
    engine = make_engine(rt, RolloutSettings())
    assert isinstance(engine, HFEngine) and engine.drafts is not None


async def test_a_forced_reply_scores_as_the_sampled_one_did(engine_at) -> None:
    """Teacher forcing (a scripted reply): forcing what the engine sampled gives back the ids, the log-probs
    and the alternatives it sampled them with, and the request ends there, alongside sampled ones."""
    engine = await engine_at()
    sampled = await engine.generate(req("s", PROMPTS[1], 12, temperature=0.7, top_logprobs=3))
    assert sampled.output_ids is not None and sampled.output_logprobs is not None
    forced, other = await asyncio.gather(
        engine.generate(
            req("f", PROMPTS[1], 12, temperature=0.7, top_logprobs=3, forced_ids=sampled.output_ids)
        ),
        engine.generate(req("o", PROMPTS[2], 9)),
    )
    assert forced.output_ids == sampled.output_ids and forced.finish_reason == "length"
    assert forced.output_logprobs == pytest.approx(sampled.output_logprobs, abs=1e-4)
    assert forced.output_top_logprobs is not None and sampled.output_top_logprobs is not None
    for a, b in zip(forced.output_top_logprobs, sampled.output_top_logprobs, strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
    assert other.output_len == 9
    # max_new_tokens cuts a forced reply as it would a sampled one.
    short = await engine.generate(req("c", PROMPTS[1], 5, forced_ids=sampled.output_ids))
    assert short.output_ids == sampled.output_ids[:5] and short.output_len == 5
    with pytest.raises(ValueError, match="forced_ids"):
        await engine.generate(req("bad", PROMPTS[1], 5, forced_ids=[-1]))


# Speculative decoding (loom.engine.clients.hf_spec)

LOOPY = [11, 12, 13, 14, 15, 16] * 4  # a prompt that repeats itself: its own tokens draft


async def test_speculative_greedy_emits_the_same_tokens_with_the_models_logprobs(engine_at, models) -> None:
    """Greedy with drafts is greedy: every token and log-prob as plain decoding has them, whole drafts kept
    along the way, rows of different draft lengths verified in one pass, masked columns compacted."""
    plain = await engine_at()
    spec = await engine_at(speculative=True)
    prompts, lengths = [LOOPY, *PROMPTS], [60, 40, 48, 30, 52]
    want = await asyncio.gather(
        *(plain.generate(req(f"r{i}", p, n)) for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)))
    )
    got = await asyncio.gather(
        *(spec.generate(req(f"r{i}", p, n)) for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)))
    )
    model = models["a"][1]
    for prompt, w, g in zip(prompts, want, got, strict=True):
        assert g.output_ids == w.output_ids == greedy(model, prompt, len(w.output_ids or []))
        logps = torch.log_softmax(full_logits(model, prompt, g.output_ids or []), dim=-1)
        ref = logps[torch.arange(len(g.output_ids or [])), torch.tensor(g.output_ids)].tolist()
        assert g.output_logprobs == pytest.approx(ref, abs=1e-4)
    stats = spec.drafts.stats if spec.drafts is not None else None
    assert stats is not None and stats.accepted > 0 and stats.steps < stats.tokens
    assert spec.load().generated_tokens == plain.load().generated_tokens == sum(lengths)


async def test_speculative_sampling_keeps_the_models_distribution(engine_at, models) -> None:
    """Sampled with drafts: each token's log-prob is the model's at its place in the context (so the cache
    behind the kept drafts is right). A cold temperature follows the tiny model's loops, so drafts are kept
    through the sampling rule; a row at top-p 0.5 is verified beside them."""
    spec = await engine_at(speculative=True)
    temps = (0.05, 0.05, 0.7)
    outs = await asyncio.gather(
        spec.generate(req("s0", PROMPTS[0], 60, temperature=temps[0])),
        spec.generate(req("s1", PROMPTS[3], 60, temperature=temps[1])),
        spec.generate(req("s2", PROMPTS[1], 24, temperature=temps[2], top_p=0.5)),
    )
    model = models["a"][1]
    for prompt, out, temp in zip((PROMPTS[0], PROMPTS[3], PROMPTS[1]), outs, temps, strict=True):
        ids = out.output_ids or []
        logps = torch.log_softmax(full_logits(model, prompt, ids) / temp, dim=-1)
        ref = logps[torch.arange(len(ids)), torch.tensor(ids)].tolist()
        assert out.output_logprobs == pytest.approx(ref, abs=1e-4)
    assert spec.drafts is not None and spec.drafts.stats.accepted > 0


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.6, 0.8)])
def test_verification_emits_each_token_from_the_plain_distribution(temperature: float, top_p: float) -> None:
    """Speculative sampling's rule for a deterministic draft, checked by chi-square: the first token
    follows the first position's distribution, and after a kept draft token the next follows the second's.
    The draft is a likely token, so both branches are exercised."""
    from loom.engine.clients.hf_spec import _target, verify_row

    torch.manual_seed(3)
    logits = torch.randn(2, 6) * 1.5
    temp_logps = torch.log_softmax(logits / temperature, dim=-1)
    p0, p1 = _target(temp_logps[0], top_p), _target(temp_logps[1], top_p)
    draft = [int(p0.argmax())]
    n = 6000
    first = torch.zeros(6)
    second = torch.zeros(6)
    for i in range(n):
        seq = Seq(
            req("v", [1], 4, temperature=temperature, top_p=top_p),
            [1],
            0,
            None,  # type: ignore[arg-type]
            request_generator(11, str(i)),
            0.0,
        )
        emitted, kept = verify_row(seq, draft, logits)
        first[emitted[0][0]] += 1
        assert kept == (emitted[0][0] == draft[0]) and len(emitted) == kept + 1
        assert emitted[0][1] == pytest.approx(float(temp_logps[0, emitted[0][0]]), abs=1e-5)
        if kept:
            second[emitted[1][0]] += 1
    for counts, p in ((first, p0), (second, p1)):
        support = p > 0
        assert counts[~support].sum() == 0  # nothing outside the nucleus
        expected = p[support] * counts.sum()
        chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
        assert chi2 < 20.5, (counts, expected)  # df <= 5: p < 0.001 beyond


def test_rejected_draft_columns_are_masked_then_compacted_away(models) -> None:
    """Thirty verification steps whose drafts are all refused: the batch's cache is compacted, and the next
    step's logits for each row equal one forward pass over its prompt and output."""
    from loom.engine.clients.hf_batch import BatchKV, prefill

    model = models["a"][1]
    batch = BatchKV()
    seqs = []
    with torch.inference_mode():
        for i, prompt in enumerate(PROMPTS[:3]):
            seq = Seq(req(f"c{i}", prompt, 64), list(prompt), i, None, request_generator(0, str(i)), 0.0)  # type: ignore[arg-type]
            cache, logits = prefill(model, prompt)
            seq.output_ids.append(int(logits.argmax()))
            batch.add(seq, cache)
            seqs.append(seq)
        widths = []
        for step in range(30):
            drafts = [[(7 * step + i) % 900 + 3] * (1 + (step + i) % 4) for i in range(len(seqs))]
            logits = batch.verify(model, drafts)
            for i, seq in enumerate(seqs):
                seq.output_ids.append(int(logits[i, 0].argmax()))
            batch.keep([1] * len(seqs), logits.shape[1])
            widths.append(batch.mask.shape[1])
        assert any(b < a for a, b in itertools.pairwise(widths))  # compacted at least once
        last = batch.step(model)
        for i, seq in enumerate(seqs):
            ref = full_logits(model, seq.prompt, [*seq.output_ids, 0])[-1]
            assert torch.allclose(last[i], ref, atol=1e-4)
