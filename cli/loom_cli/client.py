"""A small REST client for the scheduler API."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx

from loom import auth


class ApiError(RuntimeError):
    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


class LoomClient:
    def __init__(self, base_url: str, token: str | None = None, timeout: float = 30.0) -> None:
        headers = auth.header(token) if token else {}
        self.http = httpx.Client(base_url=base_url, timeout=timeout, headers=headers)

    def close(self) -> None:
        self.http.close()

    def _check(self, r: httpx.Response) -> Any:
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail", r.text)
            except ValueError:
                detail = r.text
            raise ApiError(r.status_code, detail)
        return r.json()

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = self._check(self.http.post("/v1/jobs", json=spec))
        return out

    def job(self, job_id: str) -> dict[str, Any]:
        out: dict[str, Any] = self._check(self.http.get(f"/v1/jobs/{job_id}"))
        return out

    def jobs(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self._check(self.http.get("/v1/jobs"))["jobs"]
        return out

    def cancel(self, job_id: str) -> dict[str, Any]:
        out: dict[str, Any] = self._check(self.http.delete(f"/v1/jobs/{job_id}"))
        return out

    def trajectories(self, job_id: str) -> Iterator[bytes]:
        """The job's stored trajectories as NDJSON lines."""
        with self.http.stream("GET", f"/v1/jobs/{job_id}/trajectories", params={"format": "ndjson"}) as r:
            if r.status_code >= 400:
                r.read()
                self._check(r)
            for line in r.iter_lines():
                if line:
                    yield line.encode()
