"""``loom images build|list``: sandbox images, built offline from a Debian root filesystem and a wheelhouse."""

from __future__ import annotations

import argparse
import asyncio
import json

from loom.sandbox import engine, images


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("images", help="build and list sandbox images")
    cmds = p.add_subparsers(dest="images_cmd", required=True)
    b = cmds.add_parser("build", help="build the sandbox image (debootstrap + wheels, no pulls)")
    b.add_argument(
        "--package",
        action="append",
        dest="packages",
        help=f"a pip requirement to install into the image (repeatable; default: {' '.join(images.DEFAULT_PACKAGES)})",
    )
    b.add_argument("--force", action="store_true", help="rebuild even if the tag exists")
    b.set_defaults(images_run=_build)
    ls = cmds.add_parser("list", help="sandbox images on the engine")
    ls.set_defaults(images_run=_list)


def run(args: argparse.Namespace) -> int:
    return int(asyncio.run(args.images_run(args)))


async def _build(args: argparse.Namespace) -> int:
    if not await engine.ensure_engine():
        print("no Docker engine answers and none could be started here")
        return 1
    recipe = images.Recipe(tuple(args.packages)) if args.packages else images.Recipe()
    tag = await images.build(recipe, force=args.force, say=lambda s: print(s, flush=True))
    print(tag)
    return 0


async def _list(args: argparse.Namespace) -> int:
    for row in await images.images():
        print(json.dumps(row))
    return 0
