"""Users and scrypt-hashed passwords.

A password hash is the text ``scrypt$<n>$<r>$<p>$<salt b64>$<hash b64>``
(``txbroker passwd`` prints one). scrypt's cost parameters follow the
Python docs' interactive-login recommendation (n=2**14, r=8, p=1).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os

#: scrypt cost: n=2**14, r=8, p=1 (hashlib / RFC 7914 interactive defaults).
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1
SALT_BYTES = 16
HASH_BYTES = 32


def hash_password(password: str, *, salt: bytes | None = None) -> str:
    """Hash a password for the config file's ``[users]`` table."""
    salt = salt if salt is not None else os.urandom(SALT_BYTES)
    digest = hashlib.scrypt(password.encode(), salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P,
                            dklen=HASH_BYTES)
    return "$".join(["scrypt", str(SCRYPT_N), str(SCRYPT_R), str(SCRYPT_P),
                     base64.b64encode(salt).decode(), base64.b64encode(digest).decode()])


def verify_password(password: str, stored: str) -> bool:
    """True if ``password`` matches ``stored`` (constant-time compare)."""
    try:
        scheme, n, r, p, salt_b64, hash_b64 = stored.split("$")
        if scheme != "scrypt":
            return False
        salt = base64.b64decode(salt_b64)
        expected = base64.b64decode(hash_b64)
        digest = hashlib.scrypt(password.encode(), salt=salt, n=int(n), r=int(r), p=int(p),
                                dklen=len(expected))
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(digest, expected)


class Authenticator:
    """Checks users against the configured table; open when it is empty."""

    def __init__(self, users: dict[str, str]) -> None:
        self.users = dict(users)
        self._cache: dict[tuple[str, str], bool] = {}

    @property
    def open(self) -> bool:
        """True when no users are configured: anyone may connect (loopback only)."""
        return not self.users

    def check(self, user: str | None, password: str | None) -> bool:
        """True if ``user`` may connect with ``password`` (always, when open)."""
        if self.open:
            return True
        if user is None or password is None or user not in self.users:
            return False
        key = (user, password)
        if key not in self._cache:  # scrypt costs ~50 ms: remember good answers
            ok = verify_password(password, self.users[user])
            if not ok:
                return False
            self._cache[key] = True
        return True
