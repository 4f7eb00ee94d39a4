"""A new API token works wherever a user gives it as `--token TOKEN`."""

from __future__ import annotations

import argparse

from loom.identity.auth import MIN_TOKEN_LEN, new_token


def test_no_new_token_reads_as_an_option() -> None:
    """One ``secrets.token_urlsafe`` in 64 starts with "-", and argparse then answers "--token: expected one
    argument" (CI, examples/textarena/play.py with `loom up`'s token). Among 2,000 tokens the old code made
    such a one all but surely (1 - (63/64)^2000)."""
    p = argparse.ArgumentParser()
    p.add_argument("--token", required=True)
    for _ in range(2000):
        token = new_token()
        assert len(token) >= MIN_TOKEN_LEN and not token.startswith("-")
        assert p.parse_args(["--token", token]).token == token
