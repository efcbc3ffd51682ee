"""The audit log's keys: where they live, how they are read, and how one is retired.

Each audit entry (and each anchor line) carries an HMAC-SHA-256 under a key the store does
not hold, and the id of that key (the first 8 hex digits of the key's SHA-256), so entries
written before a rotation still verify under the key they were written with.

Where the key comes from, first found wins:

- ``RUNHEALTH_AUDIT_KEY``: the secret itself (32 characters or more);
- the key file ``RUNHEALTH_AUDIT_KEY_FILE``, default ``<db>.audit-key`` beside an SQLite store
  (``<database name>.audit-key`` in the working directory for another backend, as the admin
  token), mode 0600, created on first use while the log holds no keyed entry.

Retired keys, still used to verify: the files of ``<key file>.retired/`` and the secrets of
``RUNHEALTH_AUDIT_OLD_KEYS`` (comma-separated). ``rotate`` moves the key file there and writes
a new one; writers read the key file at each append, so a running service signs with the new
key from its next entry on.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import URL

from monitor.store.db import StoreError, sqlite_path

KEY_VARIABLE = "RUNHEALTH_AUDIT_KEY"
OLD_KEYS_VARIABLE = "RUNHEALTH_AUDIT_OLD_KEYS"
KEY_FILE_VARIABLE = "RUNHEALTH_AUDIT_KEY_FILE"
# A secret shorter than this is refused: HMAC-SHA-256 wants at least 32 bytes of key.
MIN_SECRET = 32


class AuditKeyError(StoreError):
    """An audit key that is missing where one is required, or unsafe to use; one line."""


def key_id(secret: bytes) -> str:
    return hashlib.sha256(secret).hexdigest()[:8]


@dataclass(frozen=True)
class Key:
    id: str
    secret: bytes

    @classmethod
    def of(cls, secret: bytes) -> Key:
        return cls(key_id(secret), secret)

    def sign(self, purpose: str, *parts: object) -> str:
        """HMAC-SHA-256 of ``purpose`` and ``parts``, one per line, with this key's id."""
        message = "\n".join([purpose, self.id, *(str(part) for part in parts)]).encode()
        return hmac.new(self.secret, message, hashlib.sha256).hexdigest()

    def signed(self, mac: str | None, purpose: str, *parts: object) -> bool:
        return mac is not None and hmac.compare_digest(mac, self.sign(purpose, *parts))


@dataclass(frozen=True)
class Keyring:
    """The key new entries are signed with, and the retired keys old ones may name."""

    signing: Key
    retired: tuple[Key, ...] = ()

    def find(self, wanted: str | None) -> Key | None:
        return next((k for k in (self.signing, *self.retired) if k.id == wanted), None)


@dataclass(frozen=True)
class KeySource:
    """Where a store's audit key is read from; read at each use, never cached."""

    store: str
    secret: str | None = None
    old_secrets: tuple[str, ...] = ()
    key_file: Path | None = None

    @property
    def retired_dir(self) -> Path | None:
        return None if self.key_file is None else self.key_file.with_name(self.key_file.name + ".retired")

    def keyring(self, *, create: bool = False) -> Keyring:
        """The keyring; ``create`` writes a new 0600 key file where none is yet."""
        signing = self._signing(create)
        retired = [Key.of(_secret(s, OLD_KEYS_VARIABLE)) for s in self.old_secrets]
        if self.retired_dir is not None and self.retired_dir.is_dir():
            retired += [Key.of(_read_key_file(p)) for p in sorted(self.retired_dir.iterdir()) if p.is_file()]
        return Keyring(signing, tuple(k for k in retired if k.id != signing.id))

    def available(self) -> bool:
        """A key is set or its file exists (it may still be unusable: ``keyring`` says why)."""
        return bool(self.secret) or (self.key_file is not None and self.key_file.exists())

    def describe(self) -> str:
        return f"${KEY_VARIABLE}" if self.secret else str(self.key_file or f"${KEY_VARIABLE}")

    def _signing(self, create: bool) -> Key:
        if self.secret:
            return Key.of(_secret(self.secret, KEY_VARIABLE))
        if self.key_file is None:
            raise AuditKeyError(
                f"no audit key for {self.store}: set {KEY_VARIABLE} or {KEY_FILE_VARIABLE} (a 0600 file)"
            )
        if create and not self.key_file.exists():
            _create_key_file(self.key_file)
        if not self.key_file.exists():
            raise AuditKeyError(
                f"no audit key: {self.key_file} does not exist (set {KEY_VARIABLE} or "
                f"{KEY_FILE_VARIABLE} to the key the audit log was written with)"
            )
        return Key.of(_read_key_file(self.key_file))


def key_source(url: URL, environ: Mapping[str, str]) -> KeySource | None:
    """The store's key source; ``None`` for an in-memory store with no key set."""
    old = tuple(s.strip() for s in environ.get(OLD_KEYS_VARIABLE, "").split(",") if s.strip())
    named = environ.get(KEY_FILE_VARIABLE, "").strip()
    default = beside_store(url, ".audit-key")
    key_file = Path(named).expanduser().absolute() if named else default
    secret = environ.get(KEY_VARIABLE, "").strip() or None
    if secret is None and key_file is None:
        return None
    return KeySource(url.render_as_string(hide_password=True), secret, old, key_file)


def beside_store(url: URL, suffix: str) -> Path | None:
    """``<db><suffix>`` beside an SQLite file; ``<database name><suffix>`` in the working
    directory for another backend (where ``runhealth serve`` keeps its admin token)."""
    path = sqlite_path(url)
    if path is not None:
        return path.with_name(path.name + suffix)
    if url.get_backend_name() == "sqlite" or not url.database:
        return None
    return Path(f"{url.database}{suffix}").absolute()


def rotate(source: KeySource) -> tuple[str, str]:
    """Retire the key file's key (into ``<key file>.retired/<id>``) and write a new one;
    returns (old id, new id)."""
    if source.secret or source.key_file is None:
        raise AuditKeyError(
            f"the audit key comes from ${KEY_VARIABLE}: rotate it there (the old secret into "
            f"${OLD_KEYS_VARIABLE})"
        )
    old = Key.of(_read_key_file(source.key_file))
    retired = source.retired_dir
    assert retired is not None
    retired.mkdir(mode=0o700, exist_ok=True)
    target = retired / old.id
    if not target.exists():
        os.link(source.key_file, target)  # the old key is kept before the new one replaces it
    fresh = source.key_file.with_name(source.key_file.name + ".new")
    fresh.unlink(missing_ok=True)
    _create_key_file(fresh)
    fresh.replace(source.key_file)
    return old.id, Key.of(_read_key_file(source.key_file)).id


def _secret(text: str, where: str) -> bytes:
    if len(text) < MIN_SECRET:
        raise AuditKeyError(f"the audit key in {where} is too short: {MIN_SECRET} characters or more")
    return text.encode()


def _read_key_file(path: Path) -> bytes:
    try:
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise AuditKeyError(
                f"the audit key file {path} is open to others (mode {stat.S_IMODE(mode):04o}): chmod 600 {path}"
            )
        return _secret(path.read_text().strip(), str(path))
    except OSError as exc:
        raise AuditKeyError(f"cannot read the audit key file {path}: {exc.strerror}") from None


def _create_key_file(path: Path) -> None:
    """Written whole, then linked into place: a concurrent reader never sees it half written,
    and of two writers creating it at once the first link wins and both use its key."""
    path.parent.mkdir(parents=True, exist_ok=True)
    draft = path.with_name(f"{path.name}.{os.getpid()}.draft")
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, stat.S_IRUSR | stat.S_IWUSR)
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_hex(32) + "\n")
    try:
        os.link(draft, path)
    except FileExistsError:
        pass
    finally:
        draft.unlink()
