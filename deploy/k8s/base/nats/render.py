"""Makes nats-server's configuration when a NATS pod starts (the init container, on Loom's own image): the
cluster template beside this file, the routes' password put in, and Loom's users appended exactly as
``loom up`` and compose make them (``loom.identity.nats_auth.authorization``: one user per role, with its subject
permissions) with the passwords of the Secret ``loom-nats-users`` (one key per role, and ``routes``).

usage: python3 render.py TEMPLATE SECRET_DIR OUTPUT

A missing password, a placeholder or one under 16 characters stops the pod with the reason: NATS never
starts on the example Secret.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from loom.identity.nats_auth import ROLES, authorization

MIN_LEN = 16
# The routes' password sits in the route URLs: URL-safe characters only.
URL_SAFE = re.compile(r"^[A-Za-z0-9_-]+$")


def secret(directory: Path, key: str) -> str:
    path = directory / key
    value = path.read_text().strip() if path.exists() else ""
    if len(value) < MIN_LEN or "REPLACE" in value.upper():
        sys.exit(
            f"loom-nats-users: the password of {key!r} is missing, a placeholder or under {MIN_LEN} "
            "characters; make the Secret with deploy/k8s/make-secrets.sh (deploy/k8s/README.md)"
        )
    return value


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    template, directory, out = Path(argv[0]), Path(argv[1]), Path(argv[2])
    route = secret(directory, "routes")
    if not URL_SAFE.match(route):
        sys.exit("loom-nats-users: the routes password may hold only letters, digits, '-' and '_'")
    passwords = {role: secret(directory, role) for role in ROLES}
    text = template.read_text().replace("ROUTE_PASSWORD", route) + authorization(passwords)
    out.unlink(missing_ok=True)  # left by an earlier start of this pod, and read-only
    out.write_text(text)
    out.chmod(0o400)
    print(f"wrote {out}: cluster member with users {', '.join(ROLES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
