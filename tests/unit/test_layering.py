"""The layers of DESIGN.md's shape, held: protocol at the bottom, then what everything reads (settings, text,
traces), the NATS runtime, the libraries, the integrations, the benchmarks, the services, the CLI at the top. An
import may only run down or sideways; no two packages import each other, even through others; no service
imports another; the CLI imports no service (it starts them as processes)."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Each unit (a package or module under loom, a service, the CLI) and its layer, lowest first.
LAYERS: dict[str, int] = {
    "loom.protocol": 0,
    # What everything reads: settings, the clock, metrics, logs, text (tokenizer, chat), data (traces), checkpoints.
    **dict.fromkeys(
        (
            "loom",
            "loom.settings",
            "loom.clock",
            "loom.metrics",
            "loom.logs",
            "loom.text",
            "loom.data",
            "loom.checkpoints",
        ),
        1,
    ),
    # The NATS runtime, identity (whose NATS users and permissions are written with the runtime's bus), and
    # moving weights (which the engines and the trainers both speak).
    **dict.fromkeys(("loom.runtime", "loom.identity", "loom.weights"), 2),
    **dict.fromkeys(
        (
            "loom.policies",
            "loom.engine",
            "loom.envs",
            "loom.rewards",
            "loom.predict",
            "loom.sandbox",
            "loom.speculative",
            "loom.trainer",
            "loom.workloads",
        ),
        3,
    ),
    "loom.integrations": 4,
    "loom.bench": 5,
    "services": 6,
    **{f"services.{s}": 6 for s in ("scheduler", "router", "rollout", "predictor", "envmgr", "reward")},
    "loom_cli": 7,
}


def unit(module: str) -> str | None:
    """The unit a dotted module name belongs to (None: not Loom's)."""
    parts = module.split(".")
    if parts[0] == "loom":
        return ".".join(parts[:2])
    if parts[0] == "services":
        return ".".join(parts[:2]) if len(parts) > 1 else "services"
    if parts[0] == "loom_cli":
        return "loom_cli"
    return None


def sources() -> Iterator[tuple[str, str]]:
    """(module name, source) of every module of the libraries, the services and the CLI."""
    for top, base in (("libs/loom", "libs"), ("services", "."), ("cli/loom_cli", "cli")):
        for f in sorted((ROOT / top).rglob("*.py")):
            rel = f.relative_to(ROOT / base).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            yield ".".join(parts), f.read_text()


def imports(source: str) -> Iterator[str]:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def violations(modules: Iterable[tuple[str, str]]) -> list[str]:
    """Every import that breaks the layering, and every circle between units."""
    out: list[str] = []
    edges: dict[str, set[str]] = {}
    for name, source in modules:
        src = unit(name)
        if src is None:
            continue
        if src not in LAYERS:
            out.append(f"{name}: {src} has no layer (give it one in LAYERS)")
            continue
        for imported in imports(source):
            dst = unit(imported)
            if dst is None or dst == src:
                continue
            if dst not in LAYERS:
                out.append(f"{name} imports {imported}: {dst} has no layer")
            elif LAYERS[dst] > LAYERS[src]:
                out.append(f"{name} imports {imported} from above it (layer {LAYERS[dst]} > {LAYERS[src]})")
            elif src.startswith("services.") and dst.startswith("services."):
                out.append(f"{name} imports {imported}: a service imports no other")
            elif src == "loom_cli" and dst.startswith("services."):
                out.append(f"{name} imports {imported}: the CLI imports no service (it starts them)")
            else:
                edges.setdefault(src, set()).add(dst)
    out += [f"circle between {' -> '.join(c)}" for c in circles(edges)]
    return out


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one unit (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_import_runs_down_the_layers_and_none_circles() -> None:
    modules = list(sources())
    assert len(modules) > 200
    assert violations(modules) == []


def test_the_check_fails_on_an_upward_import_a_circle_and_a_service_importing_another() -> None:
    modules = list(sources())
    planted = [
        ("loom.policies.planted", "from services.router.router import Router\n"),
        ("loom.protocol.planted", "import loom.runtime.bus\n"),
        ("services.envmgr.planted", "from services.scheduler import jobs\n"),
        ("loom_cli.planted", "from services.predictor.settings import PredictorSettings\n"),
        ("loom.engine.planted", "from loom.policies import order\n"),  # policies import the engine: a circle
        ("loom.newthing", "import os\n"),
    ]
    found = violations(modules + planted)
    assert len(found) == 6, found
    assert "loom.policies.planted imports services.router.router from above it (layer 6 > 3)" in found
    assert "loom.protocol.planted imports loom.runtime.bus from above it (layer 2 > 0)" in found
    assert "services.envmgr.planted imports services.scheduler: a service imports no other" in found
    assert (
        "loom_cli.planted imports services.predictor.settings: the CLI imports no service (it starts them)"
        in found
    )
    assert "circle between loom.engine -> loom.policies" in found
    assert "loom.newthing: loom.newthing has no layer (give it one in LAYERS)" in found
