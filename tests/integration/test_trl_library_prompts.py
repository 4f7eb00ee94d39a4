"""TRL with a library's environment: a prompt that is text names one of the library's generated tasks by its id,
as its rows do in a dataset of ``{"prompt": "3"}`` (it was read as text and refused: "reasoning-gym's chain_sum
has no task 'p0'"). A real scheduler on a real nats-server takes the job LoomRollout builds."""

from __future__ import annotations

from pathlib import Path

import httpx

from loom.integrations.trl import LoomRollout
from loom_cli.deploy import free_port
from services.scheduler.settings import SchedulerSettings
from tests.conftest import API_TOKEN, AUTH, Services
from tests.integration.helpers import start_scheduler_api


async def test_text_prompts_of_a_library_environment_are_its_task_ids(
    services: Services, tmp_path: Path
) -> None:
    api = await start_scheduler_api(services, SchedulerSettings(port=free_port(), api_token=API_TOKEN))
    rollout = LoomRollout(api, API_TOKEN, env="reasoning_gym:chain_sum", checkpoints=tmp_path)
    tasks = [rollout._task(p, i) for i, p in enumerate(["3", "17"])]
    assert tasks == [{"id": "3", "data": {}}, {"id": "17", "data": {}}]
    spec = {"env": rollout.env, "tasks": tasks, "group_size": 2, "max_turns": 1}
    async with httpx.AsyncClient(base_url=api, headers=AUTH, timeout=30) as http:
        r = await http.post("/v1/jobs", json=spec)
        assert r.status_code == 201, r.text
        job = (await http.get(f"/v1/jobs/{r.json()['id']}", params={"tasks": True})).json()
    assert [t["id"] for t in job["spec"]["tasks"]] == ["3", "17"]
    assert all(
        t["data"]["prompt"] for t in job["spec"]["tasks"]
    )  # the library's own statements of tasks 3 and 17
    # Text for an environment that takes any text stays text.
    assert LoomRollout(api, API_TOKEN, env="coin")._task("guess heads", 0) == {
        "id": "p0",
        "data": {"prompt": "guess heads"},
    }
