"""The length predictor end to end: `loom predictor train` on a few trajectories (a real subprocess), its
ONNX export, and the service answering over a real nats-server, with and without a model file."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest
from nats.aio.client import Client as NATS

from loom.predict import context
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
    cmd += ["--minutes", "1", "--out", str(out)]
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


async def test_service_serves_the_model_and_falls_back_to_history(
    trained: Path, services: Services, nc: NATS, tmp_path: Path
) -> None:
    settings = PredictorSettings(model_path=trained / "model.onnx")
    await services.start("p", "predictor", settings, lambda rt: PredictorService(rt, settings))
    pieces = context.clip_pieces(["THOUGHT: reproduce it\n```bash\npython repro.py\n```\n"] * 3)
    req = PredictRequest("j", "t1", "task", 2, 6000, 700, prompt="Fix the bug in the parser", pieces=pieces)
    p = await request(nc, subjects.PREDICT, req, Prediction, timeout_s=10)
    assert p.method == "progressive" and p.remaining_tokens > 0
    assert p.total_tokens == pytest.approx(700 + p.remaining_tokens)
    # A request with no context cannot use the model: the history-based answer, counted as a fallback.
    bare = PredictRequest("j", "t2", "task", 1, 6000, 700)
    assert (await request(nc, subjects.PREDICT, bare, Prediction, timeout_s=10)).method == "history"

    # Samples of the same prompt that finish far above the model's estimate pull the next one's up.
    first = PredictRequest("j", "s0", "task", 0, 200, 0, prompt="Fix the bug in the parser")
    alone = await request(nc, subjects.PREDICT, first, Prediction, timeout_s=10)
    updates = await nc.subscribe(subjects.CONTROL_PRIORITY)
    for i in range(4):
        done = TrajDone("j", f"s{i + 1}", "completed", 1.0, int(alone.total_tokens * 20), 30, task_id="task")
        await nc.publish(subjects.traj_done("j"), encode(done))
    await nc.flush()
    # Each finished sibling re-blends the samples still running (s0, and t1 of the same task): their new
    # estimates go out as priority updates, rising with every long sibling.
    seen: dict[str, list[PriorityUpdate]] = {}
    for _ in range(8):
        u = decode((await updates.next_msg(timeout=5)).data, PriorityUpdate)
        seen.setdefault(u.traj_id, []).append(u)
    assert set(seen) == {"s0", "t1"} and len(seen["s0"]) == 4
    rising = [u.priority for u in seen["s0"]]
    assert all(a < b for a, b in itertools.pairwise(rising)) and rising[-1] > 3 * alone.total_tokens
    assert seen["s0"][-1].method == "progressive" and seen["s0"][-1].job_id == "j"
    # A finished trajectory is never refreshed again, and another job's samples refresh nothing here.
    long = int(alone.total_tokens * 20)
    for job, traj in (("j", "s0"), ("other-job", "x"), ("j", "s5")):
        await nc.publish(
            subjects.traj_done(job), encode(TrajDone(job, traj, "completed", 1.0, long, 9, "task"))
        )
    await nc.flush()
    for _ in range(2):  # s0's and s5's finishing refresh t1 alone
        assert decode((await updates.next_msg(timeout=5)).data, PriorityUpdate).traj_id == "t1"
    with pytest.raises(TimeoutError):
        await updates.next_msg(timeout=0.5)
    await updates.unsubscribe()
    for _ in range(50):
        reply = await nc.request(subjects.health("predictor"), b"", timeout=5)
        if decode(reply.data, Health).details["observed"] == 7:
            break
        await asyncio.sleep(0.05)
    later = await request(
        nc,
        subjects.PREDICT,
        PredictRequest(**{**msgspec.structs.asdict(first), "traj_id": "s9"}),
        Prediction,
        timeout_s=10,
    )
    assert later.method == "progressive" and later.total_tokens > 3 * alone.total_tokens
    health = decode(reply.data, Health).details
    assert set(health["blend"]) == {"model_log_sd", "within_log_sd"}
    await services.stop("p")

    missing = PredictorSettings(model_path=tmp_path / "none.onnx")
    await services.start("q", "predictor", missing, lambda rt: PredictorService(rt, missing))
    p = await request(nc, subjects.PREDICT, req, Prediction, timeout_s=10)
    assert p.method == "history"
    reply = await nc.request(subjects.health("predictor"), b"", timeout=5)
    health = decode(reply.data, Health)
    assert health.details["method"] == "history" and "no model" in health.details["fallback"]
