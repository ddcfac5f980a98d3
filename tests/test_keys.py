"""The key directory (zddrl/keys.py) and `zddrl keys`: files in pyzmq's certificate format, secrets kept
private, never overwritten, a role's allow-list, and signatures that fail on any change."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import zmq.auth

from broker_clients import cli, relay_key_dirs
from zddrl import keys as K


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for role, name in [("broker", "b"), ("learner", "l"), ("actor", "a1"), ("actor", "a2"), ("monitor", "m")]:
        K.new_key(tmp_path, role, name)
    return tmp_path


def test_keys_are_zmq_auth_certificates_with_private_secrets(root: Path) -> None:
    public, secret = zmq.auth.load_certificate(str(root / "actors" / "a1.key_secret"))
    assert secret is not None and zmq.auth.load_certificate(str(root / "actors" / "a1.key"))[0] == public
    for path in [root / "actors" / "a1.key_secret", root / "learners" / "l.sign"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert (root / "learners" / "l.sign.pub").exists() and not (root / "actors" / "a1.sign").exists()


def test_keys_are_never_overwritten_and_names_are_checked(root: Path) -> None:
    before = (root / "actors" / "a1.key_secret").read_bytes()
    with pytest.raises(K.KeysError, match="never overwritten"):
        K.new_key(root, "actor", "a1")
    assert (root / "actors" / "a1.key_secret").read_bytes() == before
    with pytest.raises(K.KeysError, match="one broker key"):
        K.new_key(root, "broker", "other")
    for bad in ["", "../x", "a/b", "-x", "x" * 65]:
        with pytest.raises(K.KeysError):
            K.new_key(root, "actor", bad)
    with pytest.raises(K.KeysError, match="role"):
        K.new_key(root, "admin", "x")


def test_the_allow_list_maps_each_public_key_to_its_role_and_name(root: Path) -> None:
    server = K.server_keys(root)
    assert sorted(server.allowed.values()) == [("actor", "a1"), ("actor", "a2"), ("learner", "l"), ("monitor", "m")]
    assert server.secret.decode() not in repr(server)  # a secret never shows in a log line
    # A public key listed under two roles would make a member's role ambiguous.
    (root / "monitors" / "copy.key").write_bytes((root / "actors" / "a1.key").read_bytes())
    with pytest.raises(K.KeysError, match="listed as"):
        K.server_keys(root)


def test_a_client_takes_its_own_secret_and_the_brokers_public_key(root: Path) -> None:
    with pytest.raises(K.KeysError, match="--key NAME"):
        K.client_keys(root, "actor")  # two actor secrets here: which one?
    client = K.client_keys(root, "actor", "a2")
    assert client.server == zmq.auth.load_certificate(str(root / "broker" / "b.key"))[0]
    assert client.secret not in repr(client).encode()
    with pytest.raises(K.KeysError, match="missing"):
        K.client_keys(root, "actor", "nobody")
    creds = K.credentials(root, "learner")
    assert creds.signer is not None and creds.signer[0] == "l" and set(creds.pins) == {"l"}


def test_a_relay_serves_with_its_own_pair_and_joins_with_the_upstreams_public_key(root: Path, tmp_path: Path) -> None:
    relay_dir, _ = relay_key_dirs(root, tmp_path / "hosts")
    assert not (relay_dir / "broker" / "b.key_secret").exists()
    own = K.server_keys(relay_dir)  # the only broker secret there...
    assert own.name == "edge" and K.server_keys(relay_dir, "edge").public == own.public  # ...or chosen by name
    with pytest.raises(K.KeysError, match="missing"):
        K.server_keys(relay_dir, "b")  # the root's public key only: no secret of it here
    creds = K.relay_credentials(relay_dir, "edge")
    assert creds.client.role == "relay" and creds.client.name == "r" and set(creds.pins) == {"l"}
    assert creds.client.server == zmq.auth.load_certificate(str(root / "broker" / "b.key"))[0] != own.public
    with pytest.raises(K.KeysError, match="choose one with --key NAME"):
        K.client_keys(relay_dir, "relay")  # as a plain client it could not tell which broker it joins
    K.new_key(tmp_path / "other", "broker", "other")
    (relay_dir / "broker" / "other.key").write_bytes((tmp_path / "other" / "broker" / "other.key").read_bytes())
    with pytest.raises(K.KeysError, match=r"other broker keys there: 2 \(b.key, other.key\)"):
        K.relay_credentials(relay_dir)
    with pytest.raises(K.KeysError, match="other broker keys there: none"):
        K.relay_credentials(root)  # the root's own directory: serving with it would be holding the root's secret


def test_a_signature_fails_on_any_change_and_any_other_signer(root: Path, tmp_path: Path) -> None:
    name, key = K.signing_key(root)
    pins = K.pinned_learners(root)
    sig = K.sign(key, b"run-a/7")
    assert K.verified(pins, name, b"run-a/7", sig)
    assert not K.verified(pins, name, b"run-a/8", sig)
    assert not K.verified(pins, "someone", b"run-a/7", sig)
    other = tmp_path / "other"
    K.new_key(other, "learner", name)  # the same name, another key: not the pinned one
    _, forged = K.signing_key(other)
    assert not K.verified(pins, name, b"run-a/7", K.sign(forged, b"run-a/7"))


def test_an_actor_needs_a_learner_key_to_pin(tmp_path: Path) -> None:
    K.new_key(tmp_path, "broker", "b")
    K.new_key(tmp_path, "actor", "a")
    with pytest.raises(K.KeysError, match="pin"):
        K.credentials(tmp_path, "actor")


@pytest.mark.slow
def test_the_keys_commands(tmp_path: Path) -> None:
    made = cli("keys", "new", "learner", "l0", "--keys", str(tmp_path))
    assert made.returncode == 0, made.stderr
    assert "l0.key_secret  (secret" in made.stdout and "l0.sign.pub  (public)" in made.stdout
    again = cli("keys", "new", "learner", "l0", "--keys", str(tmp_path))
    assert again.returncode == 2 and "never overwritten" in again.stderr
    no_keys = cli("broker", "--key", "edge")
    assert no_keys.returncode == 2 and "--key names a broker key in --keys" in no_keys.stderr, no_keys.stderr
    listed = cli("keys", "list", "--keys", str(tmp_path), "--json")
    assert [(k["role"], k["name"], k["secret"], k["signing"]) for k in json.loads(listed.stdout)] == [
        ("learner", "l0", True, True)
    ]
