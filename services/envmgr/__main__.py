"""Environment manager service: one loop per trajectory."""

from __future__ import annotations

from loom.runtime import service
from services.envmgr.manager import EnvManager
from services.envmgr.settings import EnvmgrSettings


def main() -> None:
    service.main("envmgr", EnvmgrSettings, lambda rt: EnvManager(rt, rt.settings))  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
