"""The console's users: hashed passwords, roles, basic auth, CSRF tokens."""

from __future__ import annotations

import base64

import pytest

from console.auth import Users, csrf_ok, csrf_token, hash_password
from outbox.errors import ConfigurationError


def _basic(name: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{name}:{password}".encode()).decode()


def test_a_user_signs_in_with_the_right_password_only() -> None:
    users = Users(f"ann:operator:{hash_password('s3cret')}, bob:viewer:{hash_password('pw')}")
    ann = users.check(_basic("ann", "s3cret"))
    assert ann is not None
    assert ann.can_act
    assert users.check(_basic("ann", "s3cret")) == ann  # remembered, same answer
    bob = users.check(_basic("bob", "pw"))
    assert bob is not None
    assert not bob.can_act
    for wrong in (_basic("ann", "S3cret"), _basic("eve", "s3cret"), "Basic !!!", None,
                  "Bearer x", _basic("ann", "")):
        assert users.check(wrong) is None


def test_hashes_are_salted_and_never_hold_the_password() -> None:
    one, two = hash_password("same"), hash_password("same")
    assert one != two
    assert "same" not in one
    with pytest.raises(ConfigurationError, match="empty password"):
        hash_password("")


@pytest.mark.parametrize(("spec", "said"), [
    ("ann", "not 'name:role:hash'"),
    ("ann:operator:plain", "not 'name:role:hash'"),
    ("ann:admin:" + hash_password("x", salt=b"fixed salt, ids!"), "roles are operator, viewer"),
    ("ann:viewer:scrypt$!!$b", "not 'name:role:hash'"),
], ids=["no-role", "not-a-hash", "unknown-role", "not-base64"])
def test_a_bad_users_setting_names_what_is_wrong(spec: str, said: str) -> None:
    with pytest.raises(ConfigurationError, match=said):
        Users(spec)


def test_csrf_tokens_belong_to_one_user_and_one_key() -> None:
    users = Users(f"ann:operator:{hash_password('a')},bob:operator:{hash_password('b')}")
    ann, bob = users.check(_basic("ann", "a")), users.check(_basic("bob", "b"))
    assert ann is not None
    assert bob is not None
    token = csrf_token("key", ann)
    assert csrf_ok("key", ann, token)
    assert not csrf_ok("key", bob, token)
    assert not csrf_ok("other key", ann, token)
    assert not csrf_ok("key", ann, None)


def test_a_header_that_is_not_base64_or_ascii_is_no_one() -> None:
    users = Users(f"ann:operator:{hash_password('a')}")
    for odd in ("Basic é", "Basic \x00\x01", "Basic ====", "basic"):
        assert users.check(odd) is None
