"""GRPO math: flattening trajectories, group advantages, the chunked LM head, the decoupled PPO loss."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, Qwen3Config

from loom.checkpoints import TINY, build_tiny
from loom.protocol.messages import Step, Trajectory
from loom.trainer import grpo
from loom.trainer.grpo import GRPOConfig

VOCAB = 64


def _traj(steps: list[Step], reward: float = 1.0) -> Trajectory:
    return Trajectory(
        job_id="j",
        traj_id="t1",
        task_id="x",
        group=0,
        sample=0,
        env="math",
        status="completed",
        finish_reason="done",
        steps=steps,
        started_at=0.0,
        finished_at=1.0,
        reward=reward,
    )


def _step(i: int, prompt: list[int] | None, out: list[int] | None, lps: list[float] | None) -> Step:
    n = len(out or [])
    return Step(i, len(prompt or []), n, prompt_ids=prompt, output_ids=out, output_logprobs=lps)


def _model() -> torch.nn.Module:
    """A Qwen3 as ``loom.checkpoints`` builds it, with a vocabulary of 64 (pad id 0) to keep the tests fast."""
    cfg = {**TINY, "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    cfg.update(num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    config = Qwen3Config(**cfg, bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="eager")
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


# ---------------------------------------------------------------- flatten


def test_flatten_round_trips_a_hand_built_trajectory() -> None:
    t = _traj(
        [
            _step(0, [5, 6, 7], [8, 9, 1], [-0.5, -0.25, -1.0]),
            _step(1, [10, 11], [12, 1], [-2.0, -0.125]),
        ]
    )
    f = grpo.flatten(t)
    assert f.ids.tolist() == [5, 6, 7, 8, 9, 1, 10, 11, 12, 1]
    assert f.loss_mask.tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert f.behaviour_logprobs.tolist() == [0, 0, 0, -0.5, -0.25, -1.0, 0, 0, -2.0, -0.125]
    # The context of call k is every earlier step's prompt and output ids, then its own prompt ids.
    ctx1 = [*t.steps[0].prompt_ids, *t.steps[0].output_ids, *t.steps[1].prompt_ids]  # type: ignore[misc]
    assert f.ids.tolist()[: len(ctx1)] == ctx1
    out1 = f.ids[f.loss_mask.bool()].tolist()[3:]
    assert out1 == t.steps[1].output_ids


@pytest.mark.parametrize(
    ("step", "words"),
    [
        (_step(0, None, [1], [0.0]), "no token ids"),
        (_step(0, [1], None, None), "no token ids"),
        (_step(0, [1], [2], None), "sampling.logprobs"),
        (_step(0, [1], [2, 3], [0.0]), "1 log-probabilities for 2 output ids"),
        (_step(0, [], [2], [0.0]), "no prompt"),
        (msgspec.structs.replace(_step(0, [1], [2], [0.0]), rebased=True), "rewrote its history"),
    ],
)
def test_flatten_refuses_steps_without_ids_or_logprobs(step: Step, words: str) -> None:
    with pytest.raises(ValueError, match=words) as e:
        grpo.flatten(_traj([step]))
    assert "t1" in str(e.value)
    with pytest.raises(ValueError, match="no steps"):
        grpo.flatten(_traj([]))


# ---------------------------------------------------------------- advantages

rewards_st = st.lists(
    st.lists(st.floats(-10, 10, allow_nan=False), min_size=1, max_size=8), min_size=1, max_size=6
)


@settings(max_examples=200, deadline=None)
@given(rewards_st, st.lists(st.floats(-100, 100, allow_nan=False), min_size=6, max_size=6), st.booleans())
def test_advantages_are_centred_per_group_and_shift_invariant(
    groups: list[list[float]], shifts: list[float], scale: bool
) -> None:
    flat = [r for g in groups for r in g]
    labels = [i for i, g in enumerate(groups) for _ in g]
    adv = grpo.group_advantages(flat, labels, scale_std=scale)
    shifted = grpo.group_advantages([r + shifts[g] for r, g in zip(flat, labels, strict=True)], labels, scale)
    for i, g in enumerate(groups):
        a = adv[torch.tensor(labels) == i]
        assert abs(float(a.sum())) < 1e-3 * max(1.0, float(a.abs().max()))
        if len(set(g)) == 1:  # no variance: no signal
            assert torch.equal(a, torch.zeros_like(a))
    # Adding a constant to a group's rewards changes nothing (up to rounding of the shifted rewards).
    assert torch.allclose(adv, shifted, atol=5e-3 if scale else 1e-4)


def test_advantages_scale_by_the_group_std_and_order_by_reward() -> None:
    adv = grpo.group_advantages([1, 0, 0, 0, 1, 1, 1, 1], ["a"] * 4 + ["b"] * 4)
    a = adv[:4]
    assert a[0] > 0 > a[1] and torch.allclose(a[1:], a[1:2].expand(3))
    assert math.isclose(float(a.std()), 1.0, rel_tol=1e-4)
    assert torch.equal(adv[4:], torch.zeros(4))
    raw = grpo.group_advantages([1, 0, 0, 0], ["a"] * 4, scale_std=False)
    assert raw.tolist() == [0.75, -0.25, -0.25, -0.25]
    with pytest.raises(ValueError):
        grpo.group_advantages([1.0, 2.0], ["a"])


# ---------------------------------------------------------------- the LM head


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("chunk", [1, 7, 100])
def test_chunked_head_matches_log_softmax_in_value_and_gradient(temperature: float, chunk: int) -> None:
    g = torch.Generator().manual_seed(1)
    h = torch.randn(23, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 8, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 50, (23,), generator=g)
    up = torch.randn(23, generator=g, dtype=torch.float64)
    got = grpo.head_logprobs(h, w, y, temperature, chunk)
    (got * up).sum().backward()
    gh, gw = h.grad, w.grad
    h.grad = w.grad = None
    want = torch.log_softmax(h @ w.t() / temperature, -1).gather(1, y[:, None])[:, 0]
    (want * up).sum().backward()
    assert torch.allclose(got, want, atol=1e-10)
    assert torch.allclose(gh, h.grad, atol=1e-10) and torch.allclose(gw, w.grad, atol=1e-10)  # type: ignore[arg-type]


@pytest.mark.parametrize("right", [True, False])
@pytest.mark.parametrize("frozen", [False, True])
def test_head_gradient_computed_ahead_matches_and_a_wrong_prediction_is_caught(
    right: bool, frozen: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(2)
    h = torch.randn(19, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(40, 8, generator=g, dtype=torch.float64, requires_grad=not frozen)
    y = torch.randint(0, 40, (19,), generator=g)
    up = torch.randn(19, generator=g, dtype=torch.float64)

    def loss_of(lp: torch.Tensor) -> torch.Tensor:  # a loss whose gradient depends on logp itself
        return (up * lp.exp()).sum()

    def grad_of(lp: torch.Tensor, at: slice) -> torch.Tensor:
        return up[at] * lp.exp() * (1.0 if right else 2.0)

    calls = []
    real = grpo._accumulate
    monkeypatch.setattr(grpo, "_accumulate", lambda *a: calls.append(1) or real(*a))
    loss_of(grpo.head_logprobs(h, w, y, 0.7, chunk=5, grad_of=grad_of)).backward()
    gh, gw = h.grad, w.grad
    assert len(calls) == (4 if right else 8)  # 4 chunks ahead, and again in the backward pass when wrong
    assert (gw is None) == frozen  # a frozen head skips its weight-gradient product
    h.grad = w.grad = None
    loss_of(torch.log_softmax(h @ w.t() / 0.7, -1).gather(1, y[:, None])[:, 0]).backward()
    assert torch.allclose(gh, h.grad, atol=1e-10)  # type: ignore[arg-type]
    assert frozen or torch.allclose(gw, w.grad, atol=1e-10)  # type: ignore[arg-type]


@pytest.mark.parametrize("train_embeddings", [False, True])
def test_the_optimizer_leaves_embeddings_alone_unless_asked(train_embeddings: bool) -> None:
    model = build_tiny(0, num_hidden_layers=1, hidden_size=16, intermediate_size=32, head_dim=8)
    emb = model.get_input_embeddings().weight
    opt = grpo.make_optimizer(model, grpo.GRPOConfig(train_embeddings=train_embeddings))
    held = {id(p) for group in opt.param_groups for p in group["params"]}
    assert (id(emb) in held) == train_embeddings == emb.requires_grad
    assert all(id(p) in held for n, p in model.named_parameters() if "layers" in n)


def test_train_step_gradient_is_the_decoupled_ppo_gradient() -> None:
    """The one-minibatch fast path (gradient computed in the forward pass) equals autograd through the loss,
    importance weights (some truncated) included."""
    batch = grpo.Batch(*(torch.cat(parts) for parts in zip(_one(1.5), _one(-0.5), strict=True)))
    shift = torch.zeros_like(batch.behaviour_logprobs)
    shift[0, 3:] = torch.tensor([0.3, -0.2, 1.5, 0.0])  # w = e^0.3, e^-0.2, the cap (not e^1.5), 1
    batch = batch._replace(behaviour_logprobs=batch.behaviour_logprobs - shift)
    cfg = GRPOConfig(max_grad_norm=1e9, is_cap=2.0)
    fast = _model()
    m = grpo.train_step(fast, torch.optim.SGD(fast.parameters(), lr=0.0), batch, cfg)
    slow = _model()
    logp = grpo.sequence_logprobs(slow, batch, cfg.temperature)
    sel = batch.loss_mask[:, 1:].bool()
    adv = batch.advantages[:, None].expand_as(sel)[sel]
    loss, stats = grpo.grpo_loss(logp, logp.detach(), batch.behaviour_logprobs[:, 1:][sel], adv, cfg)
    loss.backward()
    assert math.isclose(m["loss"], float(loss.detach()), rel_tol=1e-5)
    assert math.isclose(m["is_weight"], stats["is_weight"], rel_tol=1e-5) and stats["is_truncated"] == 1 / 8
    for a, b in zip(fast.parameters(), slow.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-7)


def test_padding_does_not_change_a_sequences_logprobs() -> None:
    model = _model()
    seqs = [([3, 4, 5], [6, 7]), ([8, 9], [10, 11, 12, 13, 14])]
    flats = [
        grpo.Flat(
            torch.tensor(p + o), torch.tensor([0.0] * len(p) + [1.0] * len(o)), torch.zeros(len(p) + len(o))
        )
        for p, o in seqs
    ]
    batch = grpo.collate(flats, [1.0, -1.0], pad_id=0)
    assert batch.input_ids.shape == (2, 7) and batch.attention_mask[0].tolist() == [1] * 5 + [0] * 2
    assert batch.loss_mask.sum() == 7 and batch.input_ids[0, 5:].tolist() == [0, 0]
    with torch.no_grad():
        together = grpo.sequence_logprobs(model, batch, 0.8)
        alone = [grpo.sequence_logprobs(model, grpo.collate([f], [0.0], pad_id=0), 0.8) for f in flats]
        logits = model(batch.input_ids[1:2]).logits[0] / 0.8  # type: ignore[operator]
    assert torch.allclose(together, torch.cat(alone), atol=1e-5)
    ref = torch.log_softmax(logits[1:6], -1).gather(1, torch.tensor([[10], [11], [12], [13], [14]]))[:, 0]
    assert torch.allclose(alone[1], ref, atol=1e-5)


# ---------------------------------------------------------------- the loss


def _one(adv: float) -> grpo.Batch:
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    mask = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    with torch.no_grad():
        lp = grpo.sequence_logprobs(
            _model(), grpo.collate([grpo.Flat(ids, mask, torch.zeros(7))], [0.0]), 1.0
        )
    behaviour = torch.zeros(7)
    behaviour[3:] = lp
    return grpo.collate([grpo.Flat(ids, mask, behaviour)], [adv])


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_one_step_raises_positive_and_lowers_negative_advantage_tokens(adv: float) -> None:
    model = _model()
    batch = _one(adv)
    with torch.no_grad():
        before = grpo.sequence_logprobs(model, batch, 1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    m = grpo.train_step(model, opt, batch, GRPOConfig(max_grad_norm=1e9))
    with torch.no_grad():
        after = grpo.sequence_logprobs(model, batch, 1.0)
    assert m["trained_tokens"] == 4 and m["grad_norm"] > 0
    assert math.isclose(m["is_weight"], 1.0, rel_tol=1e-4) and m["clip_frac"] == 0.0
    # A small step along the policy gradient moves the sequence's log-likelihood with the advantage's sign.
    assert (after.sum() - before.sum()) * adv > 1e-3


def test_zero_advantage_sequences_are_skipped_but_counted_in_the_token_mean() -> None:
    a, b = _one(1.0), _one(0.0)
    both = grpo.Batch(*(torch.cat([x, y]) for x, y in zip(a, b, strict=True)))
    grads = []
    for batch in (a, both):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        m = grpo.train_step(model, opt, batch, GRPOConfig(max_grad_norm=1e9))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert m["trained_sequences"] == 1 and m["tokens"] == 8
    # The same update, over twice the tokens.
    assert torch.allclose(grads[0], 2 * grads[1], atol=1e-6)


def test_importance_weights_are_truncated_at_the_cap() -> None:
    cfg = GRPOConfig(is_cap=2.0)
    logp = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    old = logp.detach().clone()
    behaviour = old - torch.tensor([math.log(5.0), math.log(1.5), -math.log(2.0)])  # weights 5, 1.5, 0.5
    adv = torch.ones(3)
    loss, stats = grpo.grpo_loss(logp, old, behaviour, adv, cfg)
    assert math.isclose(float(loss.detach()), -(2.0 + 1.5 + 0.5) / 3, rel_tol=1e-6)
    assert math.isclose(stats["is_weight"], 4.0 / 3, rel_tol=1e-6)
    assert math.isclose(stats["is_truncated"], 1 / 3, rel_tol=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, -torch.tensor([2.0, 1.5, 0.5]) / 3)  # type: ignore[arg-type]


def test_the_ratio_is_clipped_asymmetrically() -> None:
    cfg = GRPOConfig(clip_eps=0.2, clip_eps_high=0.28)
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 1.5, 0.5, 1.1])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    loss, stats = grpo.grpo_loss(logp, old, old, adv, cfg, n_tokens=4)
    loss.backward()
    g = logp.grad
    assert g is not None
    # Above 1 + 0.28 with A > 0, and below 1 - 0.2 with A < 0: clipped, no gradient; the others are not.
    assert g[0] == 0 and g[2] == 0 and g[1] != 0 and g[3] != 0
    assert stats["clip_frac"] == 0.5
    assert math.isclose(float(loss.detach()), -(1.28 - 1.5 - 0.8 + 1.1) / 4, rel_tol=1e-5)


def test_kl_term_needs_a_reference_and_pulls_towards_it() -> None:
    model, ref = _model(), _model()
    batch = _one(0.0)
    with pytest.raises(ValueError, match="reference"):
        grpo.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, GRPOConfig(kl_coef=0.1))

    def k3() -> float:
        with torch.no_grad():
            d = grpo.sequence_logprobs(ref, batch, 1.0) - grpo.sequence_logprobs(model, batch, 1.0)
        return float((d.exp() - d - 1).sum())

    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    start = k3()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    m = grpo.train_step(model, opt, batch, GRPOConfig(kl_coef=1.0, max_grad_norm=1e9), ref_model=ref)
    assert m["kl"] > 0 and math.isclose(m["kl"] * 4, start, rel_tol=1e-4)
    assert k3() < start


def test_minibatches_take_one_optimizer_step_each_against_the_same_old_policy() -> None:
    batch = grpo.Batch(*(torch.cat(parts) for parts in zip(_one(1.0), _one(-1.0), _one(1.0), strict=True)))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    m = grpo.train_step(model, opt, batch, GRPOConfig(minibatches=3, max_grad_norm=1e9))
    assert m["trained_sequences"] == 3 and m["trained_tokens"] == 12
    # The second and third minibatches ran on moved weights: their ratio to the old policy is no longer 1.
    assert m["is_weight"] > 0 and math.isfinite(m["loss"]) and m["clip_frac"] >= 0.0
