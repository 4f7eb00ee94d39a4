"""verl 0.9.1's PPO trainer (its own functions, on the CPU) with Loom as its rollout, against `loom up`: the
multi-turn coin game on the simulated engines.

``LoomAgentLoopManager`` is loaded as verl's trainer loads ``rollout.agent.agent_loop_manager_class`` and fed
batches as its ``fit`` makes them (its dataset's collate function, a uid per prompt, ``_get_gen_batch``,
``rollout.n`` repeats); what comes back goes through what ``fit`` does next: union with the kept batch, the
reward, the GRPO advantage, the data and timing metrics, the actor's policy loss. Under the v1 trainer, it is fed
batches as that trainer submits them and what it writes to TransferQueue is what verl's own v1 worker writes for
the same samples, read back through verl's replay buffer. ``LoomAgentLoop`` runs inside
verl's own ``AgentLoopWorker``. The simulated engines answer with placeholder ids and log-probabilities, so what
is checked is the contract, and the weight hand-off from a checkpoint saved in verl's layout; the reward is a
user function that differs within a group (``verl_rewards``), so that the advantages and the loss are not 0."""

from __future__ import annotations

import asyncio
import os
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from loom import checkpoints as policy
from loom.envs import coin, transcript
from loom.identity.allowlist import CODE_ALLOW_ENV
from loom.trainer import grpo
from tests.e2e.conftest import LoomUp, start_loom_up
from tests.verl.conftest import PROMPT_LENGTH, QUIET, RESPONSE_LENGTH, SMALL

pytestmark = [*QUIET, pytest.mark.slow, pytest.mark.timeout(600)]
TASKS = list(coin.coin_tasks("train"))[:2]


REWARD = "tests.verl.verl_rewards:sample_number"


@pytest.fixture(scope="module")
def loom_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoomUp]:
    with pytest.MonkeyPatch.context() as mp:
        allowed = os.environ.get(CODE_ALLOW_ENV, "")
        mp.setenv(CODE_ALLOW_ENV, ",".join(filter(None, [allowed, REWARD.split(":")[0]])))
        yield from start_loom_up(tmp_path_factory.mktemp("loom"))


@pytest.fixture(scope="module")
def ray_tq(loom_up: LoomUp) -> Iterator[None]:
    """One local Ray cluster for the module (starting one is most of a test's time): verl's FSDP ranks run on it,
    and TransferQueue, where verl's v1 trainer reads its rollouts. Its workers see this checkout and Loom's token."""
    import ray
    import transfer_queue as tq

    token = (loom_up.home / "api_token").read_text().strip()
    root = str(Path(__file__).parents[2])
    # CPUs as Ray counts them: TransferQueue's controller and its one storage unit hold one each (the FSDP ranks
    # ask for none); more would have Ray start more idle workers, seconds on a small machine.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": root, "LOOM_API_TOKEN": token}})  # fmt: skip
    tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
    try:
        yield
    finally:
        tq.close()
        ray.shutdown()


def _loom(up: LoomUp, checkpoints: Path, *more: str) -> list[str]:
    """The ``loom`` section on verl's command line (the token comes from LOOM_API_TOKEN)."""
    return [
        f"+loom.url={up.api}",
        "+loom.env=coin",
        "+loom.dataset=coin",
        "+loom.model=qwen3-8b",
        "+loom.max_turns=4",
        "+loom.max_tokens=32",
        "+loom.max_turn_tokens=8",
        f"+loom.job.reward='{REWARD}'",
        f"trainer.default_local_dir={checkpoints}",
        # The fleet follows the checkpoints verl saves whole (unless verl moves it in memory).
        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        "trainer.save_freq=1",
        *more,
    ]


def _save_checkpoint(checkpoints: Path, step: int) -> None:
    """What verl's checkpoint manager writes with ``hf_model`` in ``save_contents``: a whole HF model."""
    policy.save(
        policy.build_tiny(seed=step, **SMALL), checkpoints / f"global_step_{step}" / "actor" / "huggingface"
    )


def _rows(tasks: list[int]) -> list[dict[str, Any]]:
    """Coin games as verl's RLHFDataset yields them."""
    games = coin.coin_tasks("train")
    return [
        {
            "dummy_tensor": torch.tensor([0], dtype=torch.uint8),
            "raw_prompt": np.array([{"role": "user", "content": coin.prompt(games[t])}], dtype=object),
            "loom_task": t,
            "data_source": "coin",
            "reward_model": {"style": "rule", "ground_truth": str(games[t].coin)},
            "extra_info": {"index": i},
            "index": i,
        }
        for i, t in enumerate(tasks)
    ]


def _gen_batch(step: int, n: int) -> tuple[Any, Any]:
    """A training batch as verl's ``fit`` makes one: dataset rows through its collate function, a uid per
    prompt, the generation batch split off (``_get_gen_batch``), each prompt repeated ``n`` times."""
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils.dataset.rl_dataset import collate_fn

    rows = _rows(TASKS)
    batch = DataProto.from_single_dict(collate_fn(rows))
    batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in rows], dtype=object)
    gen = RayPPOTrainer._get_gen_batch(None, batch)  # type: ignore[arg-type]  # uses no trainer state
    gen.meta_info["global_steps"] = step
    return batch, gen.repeat(repeat_times=n, interleave=True)


def _check_rows(out: Any, n: int) -> None:
    """The rollout contract, row by row: each prompt n times in a row, laid out as verl lays out its own."""
    b = out.batch
    rows = len(TASKS) * n
    for key, width in [("prompts", PROMPT_LENGTH), ("responses", RESPONSE_LENGTH), ("input_ids", None)]:
        assert b[key].shape == (rows, width or PROMPT_LENGTH + RESPONSE_LENGTH), key
    for key in ("response_mask", "rollout_log_probs", "rm_scores"):
        assert b[key].shape == (rows, RESPONSE_LENGTH), key
    tasks = coin.coin_tasks("train")
    for i in range(rows):
        attention = b["attention_mask"][i]
        prompt = b["prompts"][i][attention[:PROMPT_LENGTH].bool()].tolist()
        assert prompt == transcript.encode(coin.prompt(tasks[TASKS[i // n]]))
        response = attention[PROMPT_LENGTH:]
        m = int(response.sum())
        assert response[:m].all() and not response[m:].any()
        assert b["response_mask"][i][0] == 1 and not b["response_mask"][i][m:].any()
        assert b["rm_scores"][i][m - 1] == b["rm_scores"][i].sum()
        assert b["position_ids"][i][attention.bool()].tolist() == list(range(int(attention.sum())))
    # The placeholder replies are not valid calls: the game answers, and its answer is masked out.
    assert any(
        0 in b["response_mask"][i][: int(b["attention_mask"][i, PROMPT_LENGTH:].sum())] for i in range(rows)
    )
    assert set(out.non_tensor_batch["loom_status"]) == {"completed"}
    assert len(set(out.non_tensor_batch["loom_traj_id"])) == rows


def test_verl_trains_on_loom_rollouts_through_the_agent_loop_manager(
    loom_up: LoomUp, verl_config: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.trainer.ppo.metric_utils import compute_data_metrics, compute_timing_metrics
    from verl.trainer.ppo.ray_trainer import compute_advantage
    from verl.trainer.ppo.reward import extract_reward
    from verl.utils.import_utils import load_class_from_fqn
    from verl.workers.config import ActorConfig

    monkeypatch.setenv("LOOM_API_TOKEN", (loom_up.home / "api_token").read_text().strip())
    manager_fqn = "loom.integrations.verl.LoomAgentLoopManager"
    cfg = verl_config(
        f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={manager_fqn}",
        "trainer.use_v1=false",
        *_loom(loom_up, tmp_path / "ckpt"),
    )
    n = int(cfg.actor_rollout_ref.rollout.n)
    manager_cls = load_class_from_fqn(
        cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "AgentLoopManager"
    )
    manager = manager_cls.create(
        config=cfg, llm_client=None, teacher_client=None, reward_loop_worker_handles=None
    )
    api = httpx.Client(base_url=loom_up.api, headers=loom_up.auth)

    for step in (1, 2):
        if step == 2:
            _save_checkpoint(tmp_path / "ckpt", 1)  # verl saved after step 1's update
        batch, gen = _gen_batch(step, n)
        out = manager.generate_sequences(gen)
        timing = out.meta_info.pop("timing")
        assert set(timing) == {"loom/update_weights", "loom/job"}
        _check_rows(out, n)
        # One Loom job: a group per distinct prompt, rollout.n samples each.
        job_id = api.get("/v1/jobs").json()["jobs"][-1]["id"]
        job = api.get(f"/v1/jobs/{job_id}", params={"tasks": True}).json()
        assert job["spec"]["group_size"] == n and [t["id"] for t in job["spec"]["tasks"]] == TASKS
        assert set(out.non_tensor_batch["max_global_steps"]) == {step - 1}

        # What verl's fit does with it.
        batch = batch.repeat(repeat_times=n, interleave=True).union(out)
        assert all(m == {} for m in batch.non_tensor_batch["multi_modal_inputs"])
        scores, extra = extract_reward(batch)
        assert extra == {}
        batch.batch["token_level_scores"] = batch.batch["token_level_rewards"] = scores
        batch = compute_advantage(
            batch,
            cfg.algorithm.adv_estimator,
            num_repeat=n,
            norm_adv_by_std_in_grpo=True,
            config=cfg.algorithm,
        )
        adv = batch.batch["advantages"]
        rewards = scores.sum(1)
        assert rewards.tolist() == [float(s) for _ in TASKS for s in range(n)]  # Loom's reward, row for row
        # verl's GRPO advantage is Loom's, on every model token; none on the environment's.
        loom_adv = grpo.group_advantages(rewards, list(batch.non_tensor_batch["uid"]))
        torch.testing.assert_close(
            adv, loom_adv[:, None] * batch.batch["response_mask"], rtol=1e-5, atol=1e-6
        )
        metrics = compute_data_metrics(batch, use_critic=False)
        assert metrics["response_length/max"] <= RESPONSE_LENGTH and metrics["num_turns/min"] >= 2
        assert "timing_s/loom/job" in compute_timing_metrics(batch, {"gen": 1.0, **timing})

        # The actor's vanilla PPO loss, the sampler's log-probabilities as the old ones (as verl's bypass mode).
        old = batch.batch["rollout_log_probs"]
        log_prob = (
            old + 0.1 * torch.randn(old.shape, generator=torch.Generator().manual_seed(step))
        ).requires_grad_()
        actor = ActorConfig(
            strategy="fsdp", rollout_n=n, ppo_micro_batch_size_per_gpu=n, use_torch_compile=False
        )
        loss, _ = get_policy_loss_fn("vanilla")(
            old, log_prob, adv, batch.batch["response_mask"], cfg.actor_rollout_ref.actor.loss_agg_mode, actor
        )
        loss.backward()
        model_tokens = batch.batch["response_mask"].bool()
        assert torch.isfinite(loss) and log_prob.grad[model_tokens].abs().sum() > 0
        assert not log_prob.grad[~model_tokens].any()

    # The fleet serves verl's checkpoint.
    assert api.get("/v1/models/qwen3-8b/weights").json()["version"] == "1"


def _v1_batch(step: int, rows: list[dict[str, Any]], **columns: list[Any]) -> Any:
    """A batch as verl's v1 trainer makes one: the rows through its dataset's collate function (with more
    ``columns``), a uid per prompt, not repeated (its own ``_fetch_one_gen_batch``), the step."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.rl_dataset import collate_fn

    batch_dict = collate_fn(rows)
    batch_dict.update({k: np.array(v, dtype=object) for k, v in columns.items()})
    trainer = SimpleNamespace(train_dataloader=[batch_dict], train_dataloader_it=None)
    batch = PPOTrainer._fetch_one_gen_batch(trainer)  # type: ignore[arg-type]  # uses no other trainer state
    tu.assign_non_tensor_data(batch, "global_steps", step)
    return batch


def _submit(manager: Any, step: int, batch: Any) -> None:
    """What verl's v1 trainer does with a training batch: each prompt registered in TransferQueue as pending,
    then ``generate_sequences`` (its own ``_submit_batch_to_rollout``)."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    trainer = SimpleNamespace(global_steps=step, trainer_mode="sync", agent_loop_manager=manager)
    PPOTrainer._submit_batch_to_rollout(trainer, batch.clone())  # type: ignore[arg-type]


def _sampled(buffer: Any, step: int, partition: str, prompts: int) -> tuple[list[str], dict[str, Any], Any]:
    """What verl's replay buffer samples once every prompt is done: the samples' keys, their tags and all their
    fields (then cleared, as the trainer clears a step's)."""
    import transfer_queue as tq

    meta, _ = buffer.sample(global_steps=step, partition_id=partition, batch_size=prompts)
    keys = sorted(meta.keys)
    data = tq.kv_batch_get(keys=keys, partition_id=partition)
    tq.kv_clear(keys=keys, partition_id=partition)
    return keys, dict(zip(meta.keys, meta.tags, strict=True)), data


def _job(api: httpx.Client) -> tuple[dict[str, Any], dict[str, Any]]:
    job = api.get("/v1/jobs").json()["jobs"][-1]
    return job, api.get(f"/v1/jobs/{job['id']}", params={"tasks": True}).json()["spec"]


def test_verls_v1_trainer_reads_from_loom_what_its_own_manager_writes(
    loom_up: LoomUp,
    verl_config: Callable[..., Any],
    ray_tq: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """verl's default trainer (``trainer.use_v1``, sync): Loom's manager gets the batch of distinct prompts, runs
    each prompt's ``rollout.n`` samples as one group of one job, and writes them to TransferQueue, where verl's
    replay buffer samples them; verl's own v1 worker (``AgentLoopWorkerTQ``), its agent loop returning the very
    samples Loom made, writes the same keys, tags and fields, value for value."""
    import transfer_queue as tq
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
    from verl.utils import tensordict_utils as tu
    from verl.utils.import_utils import load_class_from_fqn

    from loom.integrations.jobs import collect
    from loom.integrations.verl import sample_of
    from loom.integrations.verl.agent_loop import agent_loop_output
    from loom.integrations.verl.config import plain
    from tests.verl.replay_loop import ReplayLoop

    monkeypatch.setenv("LOOM_API_TOKEN", (loom_up.home / "api_token").read_text().strip())
    n, manager_fqn = 3, "loom.integrations.verl.LoomAgentLoopManager"
    cfg = verl_config(
        f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={manager_fqn}",
        "trainer.use_v1=true",
        f"actor_rollout_ref.rollout.n={n}",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.5",
        *_loom(loom_up, tmp_path / "ckpt"),
    )
    # What TaskRunnerV1.init_agent_loop_manager does with the class it names.
    manager = load_class_from_fqn(cfg.actor_rollout_ref.rollout.agent.agent_loop_manager_class, "AgentLoopManager").create(
        config=cfg, llm_client=None, teacher_client=None, reward_loop_worker_handles=None
    )  # fmt: skip
    buffer = ReplayBuffer(
        trainer_mode="sync",
        trainer_config={},
        max_off_policy_threshold=None,
        max_off_policy_strategy="drop",
        sampler_kwargs={},
        poll_interval=0.1,
    )
    api = httpx.Client(base_url=loom_up.api, headers=loom_up.auth)
    batch = _v1_batch(5, _rows(TASKS))
    uids = list(batch["uid"])
    _submit(manager, 5, batch)
    keys, tags, ours = _sampled(buffer, 5, "train", len(TASKS))
    # Groups whole: every prompt's n samples, from one Loom job whose groups are the prompts.
    assert keys == sorted(f"{u}_{s}_0" for u in uids for s in range(n))
    job, spec = _job(api)
    assert (spec["name"], spec["group_size"], [t["id"] for t in spec["tasks"]]) == ("verl step 5", n, TASKS)

    # verl's own v1 worker on the same batch (run here rather than as a Ray actor: the same code), its loop
    # handing back Loom's trajectories as Loom's agent loop hands them to verl, cut to verl's widths.
    lines = api.get(f"/v1/jobs/{job['id']}/trajectories", params={"format": "ndjson"}).text.splitlines()
    for (g, s), t in collect(job, spec, lines).items():
        ReplayLoop.outputs[(uids[g], s)] = agent_loop_output(
            sample_of(t).fit(PROMPT_LENGTH, RESPONSE_LENGTH), 0.0
        )
    worker = AgentLoopWorkerTQ.__ray_metadata__.modified_class(
        verl_config(
            f"actor_rollout_ref.rollout.n={n}", "actor_rollout_ref.rollout.agent.default_agent_loop=replay"
        ),
        llm_client=None,
    )

    class VerlManager:  # AgentLoopManagerTQ's dispatch, to its one worker, waiting for the samples it spawns
        def generate_sequences(self, batch: Any) -> None:
            async def run() -> None:
                await worker.generate_sequences(batch)
                await asyncio.gather(*worker.background_tasks)

            asyncio.run(run())

    _submit(VerlManager(), 5, batch)
    verl_keys, verl_tags, theirs = _sampled(buffer, 5, "train", len(TASKS))
    assert verl_keys == keys and verl_tags == tags
    fields = sorted(theirs.keys())  # iterating a TensorDict walks its rows, not its keys
    assert sorted(ours.keys()) == fields
    tensors = ["prompts", "responses", "response_mask", "loss_mask", "input_ids", "position_ids"]
    columns = ["uid", "global_steps", "raw_prompt", "loom_task", "data_source", "reward_model", "extra_info"]
    assert {
        *tensors,
        "rollout_log_probs",
        "rm_scores",
        "num_turns",
        "extra_fields",
        "session_id",
        *columns,
    } < {*fields}
    for field in fields:
        a, b = ours[field], theirs[field]
        if isinstance(a, torch.Tensor):
            assert a.is_nested == b.is_nested, field
            for x, y in zip(a.unbind() if a.is_nested else a, b.unbind() if b.is_nested else b, strict=True):
                torch.testing.assert_close(x, y, rtol=0, atol=0, msg=field)
        elif field == "metrics":  # timings
            assert [m.keys() for m in a] == [m.keys() for m in b]
        else:
            assert plain(list(a)) == plain(list(b)), field
    assert {t["status"] for t in tags.values()} == {"success"}
    scores = ours["rm_scores"].unbind()
    assert sorted(float(x.sum()) for x in scores) == sorted(float(s) for _ in TASKS for s in range(n))

    # Validation: val_kwargs' sampling, the "val" partition, and a dataset's own number of samples per prompt
    # (a job per number: one group size to a Loom job).
    batch = _v1_batch(5, _rows(TASKS), __rollout_n__=[1, 2])
    tu.assign_non_tensor_data(batch, "validate", True)
    tq.kv_batch_put(keys=list(batch["uid"]), partition_id="val",
                    tags=[{"is_prompt": True, "status": "pending", "global_steps": 5} for _ in TASKS])  # fmt: skip
    manager.generate_sequences(batch.clone())
    keys, _, data = _sampled(buffer, 5, "val", len(TASKS))
    u0, u1 = batch["uid"]
    assert keys == sorted([f"{u0}_0_0", f"{u1}_0_0", f"{u1}_1_0"])
    jobs = api.get("/v1/jobs").json()["jobs"][-2:]
    specs = [api.get(f"/v1/jobs/{j['id']}", params={"tasks": True}).json()["spec"] for j in jobs]
    assert sorted((s["group_size"], [t["id"] for t in s["tasks"]]) for s in specs) == [
        (1, TASKS[:1]),
        (2, TASKS[1:]),
    ]
    assert {s["sampling"]["temperature"] for s in specs} == {0.5}
    assert "__rollout_n__" not in data and "validate" not in data


def test_loom_agent_loop_runs_inside_verls_own_agent_loop_worker(
    loom_up: LoomUp, verl_config: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    monkeypatch.setenv("LOOM_API_TOKEN", (loom_up.home / "api_token").read_text().strip())
    registry = tmp_path / "agent_loops.yaml"
    registry.write_text("- name: loom\n  _target_: loom.integrations.verl.LoomAgentLoop\n  max_turns: 3\n")
    cfg = verl_config(
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={registry}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=loom",
        "actor_rollout_ref.rollout.n=2",
        *_loom(loom_up, tmp_path / "ckpt"),
    )
    _save_checkpoint(tmp_path / "ckpt", 7)
    worker = AgentLoopWorker(cfg, llm_client=None)
    _, gen = _gen_batch(8, 2)
    out = asyncio.run(worker.generate_sequences(gen))
    _check_rows(out, 2)
    # Each sample was its own Loom job of one trajectory; one of them moved the fleet, the rest found it moved.
    assert set(out.non_tensor_batch["max_global_steps"]) == {7}
    api = httpx.Client(base_url=loom_up.api, headers=loom_up.auth)
    assert api.get("/v1/models/qwen3-8b/weights").json()["version"] == "7"
    assert all(j["spec"]["max_turns"] == 3 for j in api.get("/v1/jobs").json()["jobs"][-4:])


def test_verls_checkpoint_manager_moves_the_fleet_in_memory_from_an_fsdp_actor(
    loom_up: LoomUp, verl_config: Callable[..., Any], ray_tq: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verl's trainer with ``rollout.checkpoint_manager_class`` set to Loom's: the manager built as verl builds
    it, ``update_weights`` called as ``fit`` calls it (at the start, then after each actor update), two FSDP2
    ranks (Ray actors, gloo) each running verl's own ``update_weights`` and ``get_per_tensor_param``; rank 0
    broadcasts the gathered model to Loom's fleet. No checkpoint is saved."""
    import ray
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import load_class_from_fqn

    from loom.integrations.verl.checkpoint import LoomCheckpointEngine
    from loom_cli.deploy import free_port
    from tests.verl.fsdp_actor import ActorGroup, FSDPActorRank

    token = (loom_up.home / "api_token").read_text().strip()
    monkeypatch.setenv("LOOM_API_TOKEN", token)
    ce = "actor_rollout_ref.rollout.checkpoint_engine"
    cfg = verl_config(
        "trainer.use_v1=false",
        "+actor_rollout_ref.rollout.checkpoint_manager_class=loom.integrations.verl.LoomCheckpointManager",
        f"{ce}.backend=loom",
        f"{ce}.custom_backend_module=loom.integrations.verl.checkpoint",
        f"{ce}.update_weights_bucket_megabytes=1",
        f"+{ce}.engine_kwargs.loom.url={loom_up.api}",
        f"+{ce}.engine_kwargs.loom.model=qwen3-8b",
        *_loom(loom_up, Path("/nonexistent")),
    )
    api = httpx.Client(base_url=loom_up.api, headers=loom_up.auth)
    now = api.get("/v1/models/qwen3-8b/weights")
    start = int(now.json()["version"]) if now.status_code == 200 else 0  # the earlier tests may have moved it
    engine_cfg = OmegaConf.to_container(cfg.actor_rollout_ref.rollout.checkpoint_engine, resolve=True)
    port = free_port()
    rank = ray.remote(num_cpus=0)(FSDPActorRank)
    ranks = [rank.remote(r, 2, port, engine_cfg) for r in range(2)]
    # What verl's trainer does with the class it names (RayPPOTrainer._init_async_rollout_manager, fit).
    manager = load_class_from_fqn(cfg.actor_rollout_ref.rollout.checkpoint_manager_class, "CheckpointEngineManager")(
        config=omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine),
        actor_wg=ActorGroup(ranks),
        replicas=[],
    )  # fmt: skip
    manager.sleep_replicas()
    assert "loom/update_s" not in manager.update_weights(
        0
    )  # a fresh start: the fleet serves step 0's weights
    for step in (1, 2):
        ray.get([r.train_step.remote(step) for r in ranks])
        full = ray.get([r.full_state.remote() for r in ranks])[0]
        metrics = manager.update_weights(start + step)
        assert metrics["loom/fleet_version"] == start + step
        # Every byte of the gathered model went out in one broadcast, checked on arrival (CRC over gloo).
        assert metrics["loom/bytes"] == sum(t.numel() * t.element_size() for t in full.values())
        assert api.get("/v1/models/qwen3-8b/weights").json()["version"] == str(start + step)
    # The step it resumes from, again: not an error, the fleet already serves it.
    assert manager.update_weights(start + 2)["loom/fleet_version"] == start + 2
    # verl's own manager (the v1 trainer's, which reads no checkpoint_manager_class) stops at its first call.
    with pytest.raises(
        RuntimeError, match=re.escape("checkpoint_manager_class=loom.integrations.verl.LoomCheckpointManager")
    ):
        LoomCheckpointEngine(bucket_size=1 << 20).prepare()
    with pytest.raises(ValueError, match="backend"):
        load_class_from_fqn("loom.integrations.verl.LoomCheckpointManager", "CheckpointEngineManager")(
            config=omega_conf_to_dataclass(verl_config().actor_rollout_ref.rollout.checkpoint_engine),
            actor_wg=None,
            replicas=[],
        )


def test_a_fleet_that_would_never_move_is_refused_at_start(verl_config: Callable[..., Any]) -> None:
    from loom.integrations.verl import LoomAgentLoopManager

    loom = ["+loom.url=http://127.0.0.1:1", "+loom.env=coin", "trainer.use_v1=false"]
    # No whole model saved, no manager moving it in memory: the fleet would stay on its first weights.
    with pytest.raises(ValueError, match="hf_model"):
        LoomAgentLoopManager.create(config=verl_config(*loom))
    manager = (
        "+actor_rollout_ref.rollout.checkpoint_manager_class=loom.integrations.verl.LoomCheckpointManager"
    )
    assert LoomAgentLoopManager.create(config=verl_config(*loom, manager)).weights is None
    # A Megatron actor hands over its weights through Megatron-Bridge's export, which is not installed here.
    with pytest.raises(RuntimeError, match="megatron-core, Megatron-Bridge"):
        LoomAgentLoopManager.create(
            config=verl_config(*loom, manager, "actor_rollout_ref.actor.strategy=megatron")
        )
    # An adapter that is not folded in would not reach the fleet: verl's update_weights drops its config.
    with pytest.raises(ValueError, match=r"lora\.merge=true"):
        LoomAgentLoopManager.create(config=verl_config(*loom, manager, "actor_rollout_ref.model.lora.rank=8"))
    # verl's v1 trainer reads no checkpoint_manager_class: it would build its own manager.
    with pytest.raises(ValueError, match="use_v1=false"):
        LoomAgentLoopManager.create(config=verl_config(*loom[:2], "trainer.use_v1=true", manager))
