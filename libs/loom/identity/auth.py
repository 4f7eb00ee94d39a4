"""Who is calling the REST API: bearer tokens, each bound to a tenant, and one admin token.

Tokens come from the operator, never from a client: ``LOOM_API_TOKEN`` is the admin's (it sees and cancels
every tenant's jobs; ``loom up`` generates one where none is set and keeps it in ``$LOOM_HOME/api_token``),
and a tokens file maps each tenant to its tokens::

    {"tenants": {"team-a": ["<token>", ...], "team-b": ["<token>"]}}

Only the SHA-256 of each token is held, and a presented token is looked up by its digest, so a lookup takes
the same time whichever token it matches, if any.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

ADMIN = "admin"
TOKEN_FILE = "api_token"
MIN_TOKEN_LEN = 16
_TENANT = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class AuthConfigError(ValueError):
    """The operator's token configuration cannot be used (the service refuses to start on it)."""


@dataclass(frozen=True)
class Principal:
    tenant: str
    admin: bool = False
    # An external agent's session key: it opens that session's gateway paths and owns nothing else.
    session: str | None = None

    def owns(self, tenant: str) -> bool:
        return self.admin or (self.session is None and tenant == self.tenant)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Tokens:
    def __init__(self, admin: str | None = None, tenants: dict[str, list[str]] | None = None) -> None:
        self._by_digest: dict[str, Principal] = {}
        if admin:
            self._add(admin, Principal(ADMIN, admin=True))
        for tenant, tokens in (tenants or {}).items():
            if not _TENANT.match(tenant) or tenant == ADMIN:
                raise AuthConfigError(f"bad tenant name {tenant!r}: letters, digits, _ and -, not {ADMIN!r}")
            for t in tokens:
                self._add(t, Principal(tenant))

    def _add(self, token: str, who: Principal) -> None:
        if len(token) < MIN_TOKEN_LEN:
            raise AuthConfigError(f"a token must have at least {MIN_TOKEN_LEN} characters")
        d = _digest(token)
        if d in self._by_digest and self._by_digest[d] != who:
            raise AuthConfigError("one token is given to two tenants")
        self._by_digest[d] = who

    @classmethod
    def load(cls, admin: str | None, path: Path | None) -> Tokens:
        tenants: dict[str, list[str]] = {}
        if path is not None:
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise AuthConfigError(f"cannot read the tokens file {path}: {e}") from e
            raw = data.get("tenants") if isinstance(data, dict) else None
            if not isinstance(raw, dict) or not all(
                isinstance(v, list) and all(isinstance(t, str) for t in v) for v in raw.values()
            ):
                raise AuthConfigError(f'{path}: expected {{"tenants": {{"<tenant>": ["<token>", ...]}}}}')
            tenants = raw
        tokens = cls(admin, tenants)
        if not tokens._by_digest:
            raise AuthConfigError(
                "no API token configured: set LOOM_API_TOKEN (the admin's) or a tokens file "
                "(LOOM_SCHEDULER_TOKENS_FILE); `loom up` generates an admin token itself"
            )
        return tokens

    def who(self, token: str) -> Principal | None:
        return self._by_digest.get(_digest(token)) if token else None

    def session_key(self, session_id: str) -> str:
        """The key an external agent presents for one session of the OpenAI gateway, and that opens nothing
        else: an HMAC of the session id under a secret made of every configured token's digest (the same
        across restarts, unknown to anyone who does not hold all the tokens)."""
        secret = hashlib.sha256(b"loom-session\0" + "".join(sorted(self._by_digest)).encode()).digest()
        return "sk-loom-" + hmac.new(secret, session_id.encode(), hashlib.sha256).hexdigest()

    def session_principal(self, path: str, token: str) -> Principal | None:
        """Who presents ``token`` on ``path`` when it is the key of the session the path is under."""
        parts = path.split("/")
        if len(parts) < 5 or parts[1:3] != ["v1", "sessions"] or not token:
            return None
        sid = parts[3]
        return Principal("", session=sid) if hmac.compare_digest(token, self.session_key(sid)) else None


def bearer(header: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` header ('' if there is none)."""
    if not header:
        return ""
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def header(token: str) -> dict[str, str]:
    """The request header that presents ``token``."""
    return {"Authorization": f"Bearer {token}"}


def new_token() -> str:
    # Never starting with "-": given as `--token TOKEN`, argparse takes it for an option ("expected one
    # argument"). One ``token_urlsafe`` in 64 does; CI met one in examples/textarena/play.py.
    while (token := secrets.token_urlsafe(32)).startswith("-"):
        pass
    return token


def home_token(home: Path, create: bool = False) -> str | None:
    """The admin token ``loom up`` keeps under its home (made, readable by its owner alone, if asked)."""
    path = home / TOKEN_FILE
    if path.exists():
        return path.read_text().strip() or None
    if not create:
        return None
    home.mkdir(parents=True, exist_ok=True)
    token = new_token()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token
