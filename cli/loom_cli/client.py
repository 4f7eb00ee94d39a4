"""A small REST client for the scheduler API.

Reads (and a cancel, which is idempotent) are asked again while the API is being taken over or its bus elects a
leader: a connection refused or cut, or a 503, for up to ``retry_s``. A submission is not: asked twice, it would
make two jobs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx

from loom.identity import auth

# How a takeover or an election meets a client: no connection, or an answer cut short.
_TRANSIENT = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError)


def _pause(r: httpx.Response | None = None) -> None:
    """Before asking again: a 503's Retry-After (at most 5 s), else half a second."""
    time.sleep(min(float(r.headers.get("retry-after") or 1), 5.0) if r is not None else 0.5)


class ApiError(RuntimeError):
    def __init__(self, status: int, detail: Any) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


class LoomClient:
    def __init__(
        self, base_url: str, token: str | None = None, timeout: float = 30.0, retry_s: float = 30.0
    ) -> None:
        headers = auth.header(token) if token else {}
        self.http = httpx.Client(base_url=base_url, timeout=timeout, headers=headers)
        self.retry_s = retry_s

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

    def _again(self, method: str, path: str, **params: Any) -> httpx.Response:
        """An idempotent call, asked again through a takeover or a bus election (see the module's doc)."""
        deadline = time.monotonic() + self.retry_s
        while True:
            try:
                r = self.http.request(method, path, params=params or None)
            except _TRANSIENT:
                if time.monotonic() >= deadline:
                    raise
                _pause()
                continue
            if r.status_code == 503 and time.monotonic() < deadline:
                _pause(r)
                continue
            return r

    def job(self, job_id: str) -> dict[str, Any]:
        out: dict[str, Any] = self._check(self._again("GET", f"/v1/jobs/{job_id}"))
        return out

    def jobs(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self._check(self._again("GET", "/v1/jobs"))["jobs"]
        return out

    def cancel(self, job_id: str) -> dict[str, Any]:
        out: dict[str, Any] = self._check(self._again("DELETE", f"/v1/jobs/{job_id}"))
        return out

    def trajectories(self, job_id: str, page: int = 500) -> Iterator[bytes]:
        """The job's stored trajectories as NDJSON lines, in the result stream's order. A read cut short (the
        server failed mid-stream, or a takeover closed it) is read again from the start, its lines already given
        skipped, for up to ``retry_s``: it ends only at the stream's end, never early on a failure."""
        given = 0
        deadline = time.monotonic() + self.retry_s
        while True:
            try:
                with self.http.stream(
                    "GET", f"/v1/jobs/{job_id}/trajectories", params={"format": "ndjson", "limit": page}
                ) as r:
                    if r.status_code == 503 and time.monotonic() < deadline:
                        _pause(r)
                        continue
                    if r.status_code >= 400:
                        r.read()
                        self._check(r)
                    seen = 0
                    for line in r.iter_lines():
                        if not line:
                            continue
                        seen += 1
                        if seen > given:  # the stream is append-only: a re-read repeats what was given
                            given = seen
                            yield line.encode()
                return
            except _TRANSIENT:
                if time.monotonic() >= deadline:
                    raise
                _pause()
