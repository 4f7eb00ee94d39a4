"""The length predictor end to end: `loom predictor train` on a few trajectories (a real subprocess), its
ONNX export, and the service answering over a real nats-server, with and without a model file."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from nats.aio.client import Client as NATS

from loom.predict import context
from loom.predict.combine import Known
from loom.protocol import (
    Health,
    Prediction,
    PredictRequest,
    PriorityUpdate,
    TrajDone,
    decode,
    encode,
    subjects,
)
from loom.runtime.bus import request
from services.predictor.service import PredictorService
from services.predictor.settings import PredictorSettings
from tests.conftest import Services, need_shared


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    need_shared("data/traces/swe-gemini3pro.jsonl.gz")
    out = tmp_path_factory.mktemp("predictor")
    cmd = [sys.executable, "-m", "loom_cli.main", "predictor", "train", "--limit", "24", "--epochs", "2"]
    cmd += ["--steps", "30", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["epochs"] >= 1 and summary["steps"] > 0
    assert (out / "model.onnx").exists() and (out / "train_state.pt").exists()
    return out


def test_onnx_matches_torch(trained: Path) -> None:
    import torch

    from loom.predict import regressor
    from loom.predict.onnx_model import OnnxRegressor, query

    q = [query("fix the parser", ["THOUGHT: look\n", "ls\n"] * 40, 2, 300, 4000), query("x", [], 0, 0, 50)]
    ort_out = OnnxRegressor(trained / "model.onnx").remaining(q)
    model = regressor.load(trained)
    ids, mask, feats = context.inputs(q, regressor.PAD_ID, model.cfg.pool)
    with torch.no_grad():
        ref = np.expm1(model(torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(feats)).numpy())
    assert np.allclose(ort_out, np.maximum(ref, 0), rtol=1e-3)


def test_a_model_whose_combiner_is_of_an_older_format_still_serves(trained: Path, tmp_path: Path) -> None:
    from loom.predict.onnx_model import OnnxRegressor, meta_path, query

    old = tmp_path / "model.onnx"
    old.write_bytes((trained / "model.onnx").read_bytes())
    meta = json.loads(meta_path(trained / "model.onnx").read_text())
    meta["combiner"] = {**meta["combiner"], "format": 2}
    meta_path(old).write_text(json.dumps(meta))
    model = OnnxRegressor(old)
    assert model.combiner is None and OnnxRegressor(trained / "model.onnx").combiner is not None
    q = [query("fix the parser", ["ls\n"], 1, 30, 400)]
    assert np.allclose(model.remaining(q), OnnxRegressor(trained / "model.onnx").remaining(q))


async def _next(sub: Any, wait_s: float = 5) -> PriorityUpdate:
    return decode((await sub.next_msg(timeout=wait_s)).data, PriorityUpdate)


async def test_service_combines_the_model_with_history_and_siblings_and_falls_back_to_history(
    trained: Path, services: Services, nc: NATS, tmp_path: Path
) -> None:
    from loom.predict.onnx_model import OnnxRegressor, query

    model = OnnxRegressor(trained / "model.onnx")
    combiner = model.combiner
    assert combiner is not None  # `loom predictor train` fitted one on its held-out prompts
    settings = PredictorSettings(model_path=trained / "model.onnx")
    await services.start("p", "predictor", settings, lambda rt: PredictorService(rt, settings))
    pieces = context.clip_pieces(["THOUGHT: reproduce it\n```bash\npython repro.py\n```\n"] * 3)
    req = PredictRequest(
        "j",
        "t1",
        "task",
        2,
        6000,
        700,
        prompt="Fix the bug in the parser",
        pieces=pieces,
        group=0,
        prompt_tokens=400,
    )
    p = await request(nc, subjects.PREDICT, req, Prediction, timeout_s=10)
    text_t1 = 700 + float(model.remaining([query(req.prompt, pieces, 2, 700, 6000)])[0])
    # What the service serves is the combiner over what it knows: here the text model's total and the
    # prompt, nothing of the task finished yet (the running sibling s0 is not there yet either).
    assert p.method == "progressive"
    assert (p.log_sd, p.slope) == combiner.trust("")  # no workload named: the least any was ranked to
    assert p.total_tokens == pytest.approx(combiner.total(Known(2, 700.0, 400.0, text_t1)), rel=1e-6)
    assert p.remaining_tokens == pytest.approx(p.total_tokens - 700)
    # A request with no context cannot use the text model: still combined, from the rest, and counted.
    bare = PredictRequest("j", "t2", "task", 1, 6000, 700, group=1, prompt_tokens=400)
    got = await request(nc, subjects.PREDICT, bare, Prediction, timeout_s=10)
    assert got.method == "combined" and got.total_tokens == pytest.approx(
        combiner.total(Known(1, 700.0, 400.0))
    )

    first = PredictRequest("j", "s0", "task", 0, 400, 0, prompt="Fix the bug in the parser", group=0)
    alone = await request(nc, subjects.PREDICT, first, Prediction, timeout_s=10)
    text_s0 = float(model.remaining([query(first.prompt, [], 0, 0, 400)])[0])
    updates = await nc.subscribe(subjects.CONTROL_PRIORITY)
    long = int(alone.total_tokens * 20)
    # Two samples of another job finish (the task's history), then one of group 0 (s0's and t1's sibling).
    for job, traj, group in (("old", "h0", 0), ("old", "h1", 0), ("j", "s1", 0)):
        done = TrajDone(job, traj, "completed", 1.0, long, 30, task_id="task", group=group)
        await nc.publish(subjects.traj_done(job), encode(done))
    await nc.flush()
    seen: dict[str, list[PriorityUpdate]] = {}
    for _ in range(2):  # only s1's finishing re-estimates its running siblings: s0 and t1, not t2 (group 1)
        u = await _next(updates)
        seen.setdefault(u.traj_id, []).append(u)
    assert set(seen) == {"s0", "t1"}
    with pytest.raises(TimeoutError):
        await _next(updates, 0.5)
    history = (float(long), float(long))
    want_s0 = combiner.total(Known(0, 0.0, 400.0, text_s0, history, (float(long),), ((2, 700.0),)))
    want_t1 = combiner.total(Known(2, 700.0, 400.0, text_t1, history, (float(long),), ((0, 0.0),)))
    assert seen["s0"][0].priority == pytest.approx(want_s0, rel=1e-6)
    assert seen["t1"][0].priority == pytest.approx(want_t1, rel=1e-6)
    assert seen["s0"][0].method == "progressive" and seen["s0"][0].job_id == "j"
    # A finished trajectory is never re-estimated again.
    await nc.publish(
        subjects.traj_done("j"), encode(TrajDone("j", "s0", "completed", 1.0, long, 9, "task", group=0))
    )
    await nc.flush()
    assert (await _next(updates)).traj_id == "t1"
    with pytest.raises(TimeoutError):
        await _next(updates, 0.5)
    await updates.unsubscribe()
    for _ in range(50):
        reply = await nc.request(subjects.health("predictor"), b"", timeout=5)
        if decode(reply.data, Health).details["observed"] == 4:
            break
        await asyncio.sleep(0.05)
    health = decode(reply.data, Health).details
    assert health["combined"] is True and "blend" not in health
    # A new sample of the task in a later group: everything finished before is its history.
    later = PredictRequest(**{**msgspec.structs.asdict(first), "traj_id": "s9", "group": 5})
    p9 = await request(nc, subjects.PREDICT, later, Prediction, timeout_s=10)
    assert p9.total_tokens == pytest.approx(
        combiner.total(Known(0, 0.0, 400.0, text_s0, (float(long),) * 4)), rel=1e-6
    )
    await services.stop("p")

    missing = PredictorSettings(model_path=tmp_path / "none.onnx")
    await services.start("q", "predictor", missing, lambda rt: PredictorService(rt, missing))
    p = await request(nc, subjects.PREDICT, req, Prediction, timeout_s=10)
    assert p.method == "history"
    reply = await nc.request(subjects.health("predictor"), b"", timeout=5)
    fallback = decode(reply.data, Health).details
    assert fallback["method"] == "history" and "no model" in fallback["fallback"]


async def test_a_request_whose_estimate_does_not_read_the_text_model_is_answered_without_it(
    trained: Path, services: Services, nc: NATS, tmp_path: Path
) -> None:
    """Where what serves a trajectory ranks by another heuristic (here the prompt's length, at step 2), the
    service neither tokenises nor batches its context; elsewhere (step 1) the text model runs as before. A
    sibling's finishing re-estimates it the same way, until a history brings it to a regime that reads the
    text model's total: then it keeps its estimate until its next request runs the model."""
    from nats.errors import NoRespondersError

    from loom.predict import combine
    from loom.predict.onnx_model import OnnxRegressor, meta_path

    text_cols = combine.cell_columns(("text",))
    reads = combine.Linear(text_cols, [0.0, 0.0, 0.0, 1.0], 0.0, [0.0] * len(text_cols), 0.5)
    by_prompt = combine.Linear(("h_prompt_length",), [1.0], 0.0, [0.0], 0.5)
    combiner = combine.Combiner(
        {"text@1": reads}, {"text@1": "combined", "text@2": "prompt_length"}, reads, {"text@2": by_prompt}
    )
    model_path = tmp_path / "model.onnx"
    model_path.write_bytes((trained / "model.onnx").read_bytes())
    meta = json.loads(meta_path(trained / "model.onnx").read_text())
    meta_path(model_path).write_text(json.dumps({**meta, "combiner": combiner.to_json()}))
    assert OnnxRegressor(model_path).combiner is not None
    settings = PredictorSettings(model_path=model_path)
    await services.start("p", "predictor", settings, lambda rt: PredictorService(rt, settings))
    pieces = context.clip_pieces(["THOUGHT: run the tests\n```bash\npytest\n```\n"] * 3)

    async def predict(step: int, group: int) -> Prediction:
        req = PredictRequest("j", f"t{step}", "task", step, 6000, 700, "Fix the parser", pieces, group, 400)
        for _ in range(100):  # until the service subscribes
            try:
                return await request(nc, subjects.PREDICT, req, Prediction, timeout_s=10)
            except NoRespondersError:
                await asyncio.sleep(0.05)
        raise AssertionError("the predictor never answered")

    async def metric(name: str) -> float:
        text = (await nc.request(subjects.metrics("predictor"), b"", timeout=5)).data.decode()
        return sum(
            float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"loom_predictor_{name}")
        )

    skipped = await predict(2, group=0)
    want = combiner.total(combine.Known(2, 700.0, 400.0, 1.0))  # any text total: it is not read
    # The same estimate the model's answers are, named alike (the router migrates on it).
    assert skipped.method == "progressive" and skipped.total_tokens == pytest.approx(want, rel=1e-9)
    assert await metric("text_unread_total") == 1 and await metric("batch_size_count") == 0
    await predict(1, group=1)
    assert await metric("text_unread_total") == 1 and await metric("batch_size_count") == 1

    updates = await nc.subscribe(subjects.CONTROL_PRIORITY)

    async def finish(job: str, traj: str) -> None:
        done = TrajDone(job, traj, "completed", 1.0, 9000, 30, task_id="task", group=0)
        await nc.publish(subjects.traj_done(job), encode(done))
        await nc.flush()

    await finish("j", "s1")  # t2's sibling: t2 is re-estimated in its regime, still without the model
    u = await _next(updates)
    assert u.traj_id == "t2" and u.priority == pytest.approx(want, rel=1e-9)
    await finish("old", "h0")  # another job's sample: the task's history (no one of its group runs)
    await finish("j", "s2")  # with a history, what serves t2 reads the model's total: no update
    with pytest.raises(TimeoutError):
        await _next(updates, 0.5)
    await updates.unsubscribe()
    await services.stop("p")
