"""Router service: trajectory-aware request routing to rollout workers."""

from __future__ import annotations

from loom.runtime import service
from services.router.router import Router
from services.router.settings import RouterSettings


def main() -> None:
    service.main("router", RouterSettings, lambda rt: Router(rt, rt.settings))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
