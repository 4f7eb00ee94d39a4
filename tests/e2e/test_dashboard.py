"""The live dashboard at /ui, opened in headless Chromium (Debian's package) against `loom up` while a job
runs: a screenshot, and checks on the page as the browser built it and on its live events."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import LoomUp

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def chromium() -> str:
    """Chromium, installed from Debian's packages where it is missing and can be; skips where it cannot be,
    unless LOOM_REQUIRE_CHROMIUM=1 (CI), where that is a failure."""
    found = shutil.which("chromium")
    if found is None and shutil.which("apt-get") and os.geteuid() == 0:
        cmd = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(cmd, env=env, capture_output=True, timeout=900, check=False)
        found = shutil.which("chromium")
    if found is None:
        if os.environ.get("LOOM_REQUIRE_CHROMIUM") == "1":
            pytest.fail("Chromium is required here and could not be installed")
        pytest.skip("needs Chromium (Debian's chromium package)")
    return found


def _browse(exe: str, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,1300",
    ]
    return subprocess.run([exe, *flags, *args, url], capture_output=True, text=True, timeout=120, check=False)


def test_the_dashboard_shows_a_running_job_in_headless_chromium(
    loom_up: LoomUp, chromium: str, tmp_path: Path
) -> None:
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps({"name": "dashboard replay", "dataset": {"name": "swe-replay", "limit": 40}}))
    r = loom_up.cli("submit", str(spec))
    assert r.returncode == 0, r.stderr
    job_id = json.loads(r.stdout)["id"]
    deadline = time.monotonic() + 120
    while (job := loom_up.job(job_id))["completed"] < 3:  # some calls and lengths to draw
        assert job["state"] in ("pending", "running") and time.monotonic() < deadline, job
        time.sleep(0.3)
    token = (loom_up.home / "api_token").read_text().strip()
    url = loom_up.cli("ui").stdout.strip()  # the signed-in link `loom ui` prints
    assert url.startswith(f"{loom_up.api}/ui?token=")

    shot = tmp_path / "dashboard.png"
    r = _browse(chromium, url, f"--screenshot={shot}")
    assert shot.exists(), r.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 30_000
    if os.environ.get("LOOM_UI_SCREENSHOT"):
        shutil.copy(shot, os.environ["LOOM_UI_SCREENSHOT"])
    dom = _browse(chromium, url, "--dump-dom").stdout
    assert job_id in dom and "dashboard replay" in dom and 'class="state-running">running<' in dom, dom[
        -3000:
    ]
    for w in ("w0", "w1"):
        assert f"<td>{w}</td>" in dom  # its queue row
        assert f">{w}</text>" in dom  # its Gantt row
    assert dom.count("<rect") >= 2 and "<circle" in dom  # model calls drawn; predicted against actual
    assert "autoscaled" in dom  # the reward service's workers
    assert token not in dom

    with httpx.Client(base_url=loom_up.api, timeout=30, follow_redirects=True) as browser:
        assert browser.get("/ui").status_code == 401
        opened = browser.get(f"/ui?token={token}")  # follows the redirect with its session cookie
        assert opened.status_code == 200 and str(opened.url).endswith("/ui") and "loom_ui" in browser.cookies
        events = []
        with browser.stream("GET", "/ui/events") as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                if len(events) == 2:
                    break
        assert events[1]["now"] > events[0]["now"] and job_id in {j["id"] for j in events[1]["jobs"]}
        assert browser.get("/v1/jobs").status_code == 401  # the cookie opens the dashboard, not the API
    assert loom_up.cli("cancel", job_id).returncode == 0
