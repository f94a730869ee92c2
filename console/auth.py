"""Who is asking: HTTP basic auth against hashed passwords, two roles, and CSRF tokens.

Passwords are stored as scrypt hashes (``outbox console hash-password``), never in clear.
Basic auth is what a browser, ``curl -u`` and a script all speak without a login page; the
price is that a browser sends the credentials with every request to the address, a forged
form on another site included. So every form that acts carries a token only a page of this
console can know (an HMAC of the user's name under the console's secret key), and a POST
without the right one is refused before anything is read from the database.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass

from outbox.errors import ConfigurationError

ROLES = ("operator", "viewer")
# scrypt's cost: 2**14 x 8 x 1 takes ~50 ms and 16 MiB here; a sign-in is checked per
# request, so a right password is remembered (as its SHA-256) for the process's life. A
# wrong one is not: it pays the whole cost every time, which slows guessing down.
N, R, P = 2**14, 8, 1


@dataclass(frozen=True)
class User:
    name: str
    role: str  # "operator" or "viewer"

    @property
    def can_act(self) -> bool:
        return self.role == "operator"


ANONYMOUS = User("anonymous", "viewer")


def hash_password(password: str, *, salt: bytes | None = None) -> str:
    """``scrypt$<salt>$<hash>`` (both base64) for ``OUTBOXKIT_CONSOLE_USERS``."""
    if not password:
        raise ConfigurationError("an empty password is not a password")
    salt = salt or secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=N, r=R, p=P, dklen=32)
    return "scrypt$" + base64.b64encode(salt).decode() + "$" + base64.b64encode(digest).decode()


def _verify(password: str, stored: str) -> bool:
    _, salt, digest = stored.split("$")
    found = hashlib.scrypt(password.encode(), salt=base64.b64decode(salt), n=N, r=R, p=P,
                           dklen=32)
    return hmac.compare_digest(found, base64.b64decode(digest))


def _well_formed(stored: str) -> bool:
    if not stored.startswith("scrypt$") or stored.count("$") != 2:
        return False
    try:
        _, salt, digest = stored.split("$")
        return bool(base64.b64decode(salt, validate=True)) and len(
            base64.b64decode(digest, validate=True)) == 32
    except ValueError:  # binascii.Error is a ValueError
        return False


# An unknown name pays the same scrypt as a known one: the time an answer takes does not
# tell which names exist.
_DECOY = "scrypt$" + base64.b64encode(b"outboxkit-decoy!").decode() + "$" + base64.b64encode(
    bytes(32)).decode()


class Users:
    """The configured users (``name:role:hash,...``); checks a basic-auth header."""

    def __init__(self, spec: str) -> None:
        self._hashes: dict[str, tuple[str, str]] = {}
        self._known: set[tuple[str, str]] = set()
        for entry in filter(None, (part.strip() for part in spec.split(","))):
            name, sep, rest = entry.partition(":")
            role, sep2, stored = rest.partition(":")
            if not (sep and sep2 and name and _well_formed(stored)):
                raise ConfigurationError(
                    f"OUTBOXKIT_CONSOLE_USERS: {name or entry[:20]!r} is not 'name:role:hash' "
                    "with a hash from `outbox console hash-password`")
            if role not in ROLES:
                raise ConfigurationError(f"OUTBOXKIT_CONSOLE_USERS: {name!r} has role {role!r}; "
                                         f"roles are {', '.join(ROLES)}")
            self._hashes[name] = (role, stored)

    @property
    def any(self) -> bool:
        return bool(self._hashes)

    def check(self, header: str | None) -> User | None:
        """The user an ``Authorization: Basic`` header names, if its password is right.
        Blocking (scrypt, ~50 ms for a password not seen right before): call it in a
        thread, not on the event loop."""
        if not header or not header.lower().startswith("basic "):
            return None
        try:
            name, _, password = base64.b64decode(header[6:]).decode().partition(":")
        except (ValueError, UnicodeDecodeError):  # not base64 (binascii.Error), not ASCII
            return None
        known = self._hashes.get(name)
        key = (name, hashlib.sha256(password.encode()).hexdigest())
        if known is not None and key in self._known:
            return User(name, known[0])
        right = _verify(password, known[1] if known is not None else _DECOY)
        if known is None or not right:
            return None
        self._known.add(key)
        return User(name, known[0])


def csrf_token(secret: str, user: User) -> str:
    """The token a form of *user* carries: forged pages elsewhere cannot compute it."""
    return hmac.new(secret.encode(), b"csrf:" + user.name.encode(), "sha256").hexdigest()


def csrf_ok(secret: str, user: User, given: str | None) -> bool:
    return given is not None and hmac.compare_digest(csrf_token(secret, user), given)
