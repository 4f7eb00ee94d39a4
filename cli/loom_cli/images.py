"""``loom images build|list``: every image Loom runs, built offline from a Debian root filesystem and wheels
built on the host: the sandbox image, and the services' and NATS images ``docker compose up`` starts."""

from __future__ import annotations

import argparse
import asyncio
import json

from loom.sandbox import engine, images, stack_images

KINDS = ("sandbox", "services", "nats")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("images", help="build and list Loom's images (sandbox, services, NATS)")
    cmds = p.add_subparsers(dest="images_cmd", required=True)
    b = cmds.add_parser("build", help="build the images (debootstrap + host-built wheels, nothing pulled)")
    b.add_argument(
        "--only",
        action="append",
        choices=KINDS,
        help="build only these (repeatable; default: all three)",
    )
    b.add_argument(
        "--package",
        action="append",
        dest="packages",
        help="a pip requirement to install into the sandbox image (repeatable; default: "
        f"{' '.join(images.DEFAULT_PACKAGES)})",
    )
    b.add_argument("--force", action="store_true", help="rebuild even if the image is up to date")
    b.set_defaults(images_run=_build)
    ls = cmds.add_parser("list", help="Loom's images on the engine")
    ls.set_defaults(images_run=_list)


def run(args: argparse.Namespace) -> int:
    return int(asyncio.run(args.images_run(args)))


async def _build(args: argparse.Namespace) -> int:
    if not await engine.ensure_engine():
        print("no Docker engine answers and none could be started here")
        return 1
    kinds = args.only or KINDS

    def say(s: str) -> None:
        print(s, flush=True)

    tags = {}
    if "sandbox" in kinds:
        recipe = images.Recipe(tuple(args.packages)) if args.packages else images.Recipe()
        tags["sandbox"] = await images.build(recipe, force=args.force, say=say)
    if "services" in kinds:
        tags["services"] = (await stack_images.build_services(force=args.force, say=say)).tag
    if "nats" in kinds:
        tags["nats"] = (await stack_images.build_nats(force=args.force, say=say)).tag
    print(json.dumps(tags))
    return 0


async def _list(args: argparse.Namespace) -> int:
    for row in await images.images((images.REPO, stack_images.SERVICES_REPO, stack_images.NATS_REPO)):
        print(json.dumps(row))
    return 0
