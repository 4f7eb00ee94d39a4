"""Sandbox images built offline: a Debian root filesystem, Python, and wheels built on the host.

No image is pulled. ``debootstrap --variant=minbase`` makes the root filesystem (cached), the host's pip
builds a wheelhouse and installs it into the tree, and the Engine API imports the tree as an image. The
tag is a digest of the recipe, so a changed package list is a new, versioned image and never a silent
rebuild under an old name.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiodocker

from loom import settings
from loom.sandbox.docker_backend import docker_url
from loom.sandbox.types import SandboxError

log = logging.getLogger(__name__)

RECIPE_VERSION = 1
REPO = "loom-sandbox"
SUITE = "bookworm"
PYTHON = "python3.11"
# What tools and test runners in the sandbox import beyond the standard library.
DEFAULT_PACKAGES = ("pytest==8.3.5",)
# Left out of the image: documentation, translations and the package manager's caches.
SLIM = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "var/cache/apt",
    "var/lib/apt/lists",
    "var/log",
)


def cache_dir() -> Path:
    return settings.cache_dir("sandbox")


def tmpdir(prefix: str) -> Path:
    # mkdtemp makes 0700 directories; the tree's root becomes the container's '/', which every user reads.
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=cache_dir()))
    d.chmod(0o755)
    return d


@dataclass(frozen=True)
class Recipe:
    packages: tuple[str, ...] = DEFAULT_PACKAGES
    suite: str = SUITE
    include: tuple[str, ...] = ("python3",)
    extra: dict[str, str] = field(default_factory=dict)

    def digest(self) -> str:
        doc = {
            "v": RECIPE_VERSION,
            "suite": self.suite,
            "include": sorted(self.include),
            "packages": sorted(self.packages),
            **self.extra,
        }
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:12]

    @property
    def tag(self) -> str:
        return f"{REPO}:{self.suite}-py311-{self.digest()}"


DEFAULT_IMAGE = Recipe().tag


def run_step(cmd: list[str], what: str, **kw: object) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    if r.returncode != 0:
        raise SandboxError(f"{what} failed ({' '.join(cmd[:3])} ...): {(r.stderr or r.stdout)[-2000:]}")


def rootfs(recipe: Recipe, say: Callable[[str], None]) -> Path:
    """The debootstrapped tree for the recipe's suite and packages (built once, then cached)."""
    key = hashlib.sha256(f"{recipe.suite}:{','.join(sorted(recipe.include))}".encode()).hexdigest()[:10]
    path = cache_dir() / f"rootfs-{recipe.suite}-{key}"
    if (path / ".complete").exists():
        return path
    if shutil.which("debootstrap") is None:
        raise SandboxError("debootstrap is not installed (apt-get install debootstrap)")
    if os.geteuid() != 0:
        raise SandboxError("debootstrap needs root")
    tmp = tmpdir("rootfs-")
    say(f"debootstrap {recipe.suite} (minbase + {', '.join(recipe.include)}) into {tmp} ...")
    run_step(
        ["debootstrap", "--variant=minbase", f"--include={','.join(recipe.include)}", recipe.suite, str(tmp)],
        "debootstrap",
    )
    (tmp / ".complete").touch()
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def wheelhouse(packages: tuple[str, ...], say: Callable[[str], None]) -> Path:
    wh = cache_dir() / "wheelhouse"
    wh.mkdir(parents=True, exist_ok=True)
    if packages:
        say(f"building wheels on the host: {' '.join(packages)}")
        run_step([sys.executable, "-m", "pip", "wheel", "-q", "--wheel-dir", str(wh), *packages], "pip wheel")
    return wh


def copy_rootfs(recipe: Recipe, say: Callable[[str], None], prefix: str) -> Path:
    """A fresh copy of the recipe's root filesystem without docs or caches, to stage an image in."""
    base = rootfs(recipe, say)
    out = tmpdir(prefix)
    run_step(["cp", "-a", f"{base}/.", str(out)], "copying the root filesystem")
    for rel in SLIM:
        shutil.rmtree(out / rel, ignore_errors=True)
    (out / ".complete").unlink(missing_ok=True)
    return out


def stage(recipe: Recipe, say: Callable[[str], None]) -> Path:
    """A copy of the root filesystem with the wheels installed, an unprivileged user, and no docs."""
    wh = wheelhouse(recipe.packages, say)
    out = copy_rootfs(recipe, say, "stage-")
    (out / "work").mkdir(exist_ok=True)
    if recipe.packages:
        target = out / "usr/local/lib" / PYTHON / "dist-packages"
        # The tree's Python is the same minor version as the host's, so the host's pip can install
        # into it; binary wheels only, nothing is compiled for the wrong interpreter.
        run_step(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--find-links",
                str(wh),
                "--only-binary=:all:",
                "--target",
                str(target),
                *recipe.packages,
            ],
            "pip install",
        )
    with open(out / "etc/passwd", "a") as f:
        f.write("loom:x:10001:10001:sandbox:/work:/usr/sbin/nologin\n")
    with open(out / "etc/group", "a") as f:
        f.write("loom:x:10001:\n")
    return out


async def exists(tag: str) -> bool:
    docker = aiodocker.Docker(url=docker_url())
    try:
        await docker.images.inspect(tag)
        return True
    except aiodocker.DockerError:
        return False
    finally:
        await docker.close()


async def build(
    recipe: Recipe | None = None, *, force: bool = False, say: Callable[[str], None] = log.info
) -> str:
    """Build and import the image for ``recipe`` unless its tag is already there; returns the tag."""
    recipe = recipe or Recipe()
    tag = recipe.tag
    if not force and await exists(tag):
        say(f"{tag} is already built")
        return tag
    tree = stage(recipe, say)
    try:
        say(f"importing {tree} as {tag}")
        import_tree(
            tree,
            tag,
            [
                "USER 10001:10001",
                "WORKDIR /work",
                "ENV LANG=C.UTF-8 PYTHONDONTWRITEBYTECODE=1",
                f"LABEL loom.recipe={recipe.digest()} loom.packages={','.join(recipe.packages) or '-'}",
            ],
        )
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    say(f"built {tag}")
    return tag


def import_tree(tree: Path, tag: str, changes: list[str]) -> None:
    """``docker import`` a root filesystem as ``tag`` with Dockerfile-style ``changes`` (USER, ENV, ...)."""
    if shutil.which("docker") is None:
        raise SandboxError("the docker client is not installed (apt-get install docker.io)")
    # The tree streams from tar straight into the engine; nothing of its size is held in memory.
    tar = subprocess.Popen(["tar", "-C", str(tree), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
    args = [a for c in changes for a in ("--change", c)]
    r = subprocess.run(
        ["docker", "import", *args, "-", tag], stdin=tar.stdout, capture_output=True, text=True
    )
    assert tar.stdout is not None
    tar.stdout.close()
    if tar.wait() != 0 or r.returncode != 0:
        raise SandboxError(f"docker import failed: {r.stderr[-1000:]}")


async def images(repos: tuple[str, ...] = (REPO,)) -> list[dict[str, object]]:
    docker = aiodocker.Docker(url=docker_url())
    try:
        rows = await docker.images.list(filters=json.dumps({"reference": list(repos)}))
    finally:
        await docker.close()
    return [
        {"tags": r.get("RepoTags"), "size_mb": round(r.get("Size", 0) / 2**20), "created": r.get("Created")}
        for r in rows
    ]
