"""The learned length predictor for ``loom demo`` and ``loom up``: with ``--predictor-minutes M`` they train a
small one where there is none (``loom predictor train`` on the recorded traces, on the CPU, once) and point
the predictor service at it; one already trained where the service looks (``$LOOM_HOME/predictor``) is
served either way.

Not by default yet: in the demo job (replayed SWE runs, whose samples replay one run exactly) the
learned model a minute of training gives plans a makespan 1.2-1.35x the history fallback's (480-516 s against
381-406 s at speed 20; 682 s before its estimates were blended with finished samples and its placement
differences shrunk to what it can rank). The default flips when the learned predictor wins in the demo too;
in ``loom bench rollout`` it already does (coding, Qwen3-14B, 64 GPUs: 2.25x slime; history 1.81x)."""

from __future__ import annotations

import subprocess
import sys
import time

from rich.console import Console

from services.predictor.settings import default_model_path

QUICK_MINUTES = 1.0
DEFAULT_MINUTES = 0.0


def ensure(console: Console, minutes: float = QUICK_MINUTES) -> dict[str, str]:
    """The environment that points the predictor service at the learned model, trained first if missing.
    Empty where none can be had (``minutes`` 0, or training failed: no traces here): the service then
    serves the history-based predictor and says so in its health and log."""
    path = default_model_path().resolve()
    if not path.exists():
        if minutes <= 0:
            console.print(f"[yellow]No length predictor at {path}[/]: serving the history-based one")
            return {}
        console.print(
            f"[bold]No length predictor at {path}[/]: training one for {minutes:g} min on the CPU "
            "(once; `loom predictor train` trains a better one)"
        )
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "loom_cli.main", "predictor", "train"]
        cmd += ["--minutes", f"{minutes:g}", "--out", str(path.parent)]
        # Its summary line goes to stderr: stdout stays the command's own (the demo ends with one JSON line).
        r = subprocess.run(cmd, stdout=sys.stderr, check=False)
        if r.returncode != 0 or not path.exists():
            console.print(
                f"[yellow]Training the length predictor failed (exit {r.returncode})[/]: serving the "
                "history-based one"
            )
            return {}
        console.print(f"length predictor trained in {time.monotonic() - t0:.0f} s: {path}")
    return {"LOOM_PREDICTOR_MODEL_PATH": str(path)}
