"""The dashboard's login: one operator password, kept only as a scrypt hash, and server-side sessions.

The password is checked once per login (scrypt is deliberately slow), never per request: a successful login
gets a random session token in a Secure, HttpOnly, SameSite=Strict cookie. Sessions live in this process only,
so restarting the dashboard logs everyone out. Login attempts are throttled before this check (throttle.py).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from broker.certs import write_private
from fedmqtt.errors import ConfigError

# scrypt cost: 2^15 x 8 x 1 takes ~0.1 s and 32 MiB, the interactive-login setting scrypt's author suggests.
SCRYPT_N, SCRYPT_R, SCRYPT_P = 1 << 15, 8, 1
SCRYPT_MAXMEM = 64 * 1024 * 1024
MIN_PASSWORD_CHARS = 12
SESSION_S = 12 * 3600
COOKIE = "fedmqtt_dashboard"
HASH_FILE = "login.scrypt"


def _scrypt(password: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(password.encode("utf-8"), salt=salt, n=n, r=r, p=p, maxmem=SCRYPT_MAXMEM, dklen=32)


@dataclass(frozen=True)
class PasswordHash:
    """`scrypt$n$r$p$salt$hash` (base64): what is stored; the password itself never is."""

    n: int
    r: int
    p: int
    salt: bytes
    digest: bytes

    @classmethod
    def of(cls, password: str) -> PasswordHash:
        if len(password) < MIN_PASSWORD_CHARS:
            raise ConfigError(f"the dashboard password must have at least {MIN_PASSWORD_CHARS} characters")
        salt = secrets.token_bytes(16)
        return cls(SCRYPT_N, SCRYPT_R, SCRYPT_P, salt, _scrypt(password, salt, SCRYPT_N, SCRYPT_R, SCRYPT_P))

    def matches(self, password: str) -> bool:
        candidate = _scrypt(password, self.salt, self.n, self.r, self.p)
        return hmac.compare_digest(candidate, self.digest)  # constant time

    def dumps(self) -> str:
        b64 = base64.b64encode
        return f"scrypt${self.n}${self.r}${self.p}${b64(self.salt).decode()}${b64(self.digest).decode()}\n"

    @classmethod
    def loads(cls, text: str) -> PasswordHash:
        try:
            tag, n, r, p, salt, digest = text.strip().split("$")
            if tag != "scrypt":
                raise ValueError(tag)
            return cls(int(n), int(r), int(p), base64.b64decode(salt), base64.b64decode(digest))
        except ValueError:
            raise ConfigError("not a dashboard password hash (scrypt$n$r$p$salt$hash)") from None


def password_from_file(path: Path) -> PasswordHash:
    """An operator's password file: its first line is the password (hashed here; only the hash is kept)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read the dashboard password file {path}: {exc.strerror}") from None
    return PasswordHash.of(lines[0] if lines else "")


def stored_password(directory: Path, *, renew: bool = False) -> tuple[PasswordHash, str | None]:
    """The hash kept in `directory`, made on first use (or on `renew`) from a new random password.

    Returns the hash and the new password (None when an existing hash was used): the caller shows it once.
    """
    path = Path(directory) / HASH_FILE
    if path.is_file() and not renew:
        return PasswordHash.loads(path.read_text(encoding="ascii")), None
    password = secrets.token_urlsafe(18)  # 144 bits
    hashed = PasswordHash.of(password)
    Path(directory).mkdir(parents=True, exist_ok=True, mode=0o700)
    write_private(path, hashed.dumps().encode("ascii"))
    return hashed, password


@dataclass
class Sessions:
    """Logged-in browsers (random tokens)."""

    password: PasswordHash
    tokens: dict[str, float] = field(default_factory=dict)  # token -> expiry (monotonic)

    def login(self, password: str, now: float | None = None) -> str | None:
        """A new session token for the right password, else None. Runs scrypt: throttle before calling."""
        now = time.monotonic() if now is None else now
        if not self.password.matches(password):
            return None
        self.tokens = {t: exp for t, exp in self.tokens.items() if exp > now}
        token = secrets.token_urlsafe(32)
        self.tokens[token] = now + SESSION_S
        return token

    def valid(self, token: str | None, now: float | None = None) -> bool:
        if not token:
            return False
        now = time.monotonic() if now is None else now
        expiry = self.tokens.get(token)  # a dict lookup: the token is 256 random bits, not a guessable secret
        return expiry is not None and expiry > now
