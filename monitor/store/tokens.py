"""Bearer tokens: generated with ``secrets``, stored only as sha256 digests."""

from __future__ import annotations

import hashlib
import hmac
import secrets


def new_token(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(32)}"


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def digest_matches(token: str, digest: str) -> bool:
    return hmac.compare_digest(token_digest(token), digest)
