"""Keys of a closed bus: one CURVE keypair per broker and per client, one Ed25519 signing key per learner.

Everything cryptographic is done by well-kept libraries: CURVE keypairs are made, written and read by
pyzmq's own ``zmq.auth`` functions (its certificate file format), signatures are Ed25519 from the
``cryptography`` package. This module only lays the files out and reads them back. The layout of a key
directory (docs/security.md)::

    KEYS/broker/NAME.key            the broker's public key: every client needs it
    KEYS/broker/NAME.key_secret     its secret key: only on the broker's host
    KEYS/learners/NAME.key          a learner's public key: the broker's allow-list of learners
    KEYS/learners/NAME.key_secret   its secret key: only on that learner's host
    KEYS/learners/NAME.sign.pub     its Ed25519 public key: actors pin it, the broker checks new runs with it
    KEYS/learners/NAME.sign         its Ed25519 secret key (PEM): signs every parameter version and run spec
    KEYS/actors/NAME.key[_secret]   actor hosts: may push trajectories and receive parameters
    KEYS/monitors/NAME.key[_secret] `zddrl status`, dashboards: may read the status, nothing else
    KEYS/relays/NAME.key[_secret]   relay brokers (`zddrl broker --upstream`): may join, push and subscribe
                                    upstream on behalf of the actors they report
    KEYS/replays/NAME.key[_secret]  replay services (`zddrl replay`): join the broker, take trajectories; the same
                                    pair serves their own socket, where only learner keys are admitted

A public file in a role's folder is that role's allow-list at the broker; a host holds the secret files of
its own keys only. A relay's directory holds two keys in ``broker/``: its own pair (its actors hold the public
file) and its upstream's public key, never the upstream's secret (``relay_credentials``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import zmq.auth

if TYPE_CHECKING:
    # ``cryptography`` is imported where a key is made, read or checked (a cost at start-up: docs/benchmarks.md):
    # every actor, broker and learner imports this module, and only those of a closed bus use it.
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

KEY_ROLES = ("broker", "learner", "actor", "monitor", "relay", "replay")
"""The roles a key can be made for (``zddrl keys new ROLE NAME``)."""
FOLDERS = {
    "broker": "broker",
    "learner": "learners",
    "actor": "actors",
    "monitor": "monitors",
    "relay": "relays",
    "replay": "replays",
}
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
PUBLIC, SECRET = ".key", ".key_secret"
SIGN_PUBLIC, SIGN_SECRET = ".sign.pub", ".sign"
KEYS_ENV = "ZDDRL_KEYS"


class KeysError(ValueError):
    """A key directory that cannot be used; the text names the file or folder and what to do."""


class KeyInfo(NamedTuple):
    role: str
    name: str
    public: str
    """The CURVE public key (Z85)."""
    secret: bool
    """Whether this directory holds its secret key (this host may act as it)."""
    signing: bool
    """Whether an Ed25519 signing pair is here (learners)."""


@dataclass(frozen=True)
class ClientKeys:
    """What a client socket needs for CURVE: its own pair and the broker's public key (all Z85)."""

    role: str
    name: str
    public: bytes
    secret: bytes = field(repr=False)
    server: bytes = b""

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client of the broker; call before ``connect``."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server


@dataclass(frozen=True)
class ServerKeys:
    """The broker's pair (Z85) and the allow-list: each client public key (Z85) -> (role, name)."""

    public: bytes
    secret: bytes = field(repr=False)
    allowed: dict[bytes, tuple[str, str]] = field(default_factory=dict)
    name: str = ""
    """The pair's name in ``broker/``."""


@dataclass(frozen=True)
class Credentials:
    """Everything a client process holds of the closed bus: its CURVE keys for every socket it opens to the
    broker, the learners' signing keys it trusts, and (learners only) its own signing key."""

    client: ClientKeys
    pins: dict[str, Ed25519PublicKey] = field(default_factory=dict)
    """Learner name -> Ed25519 public key: only runs and parameter versions signed by one of these are taken."""
    signer: tuple[str, Ed25519PrivateKey] | None = field(default=None, repr=False)
    """(name, key) of this learner's signing key; None for other roles."""

    def apply(self, sock: zmq.Socket) -> None:
        self.client.apply(sock)


def credentials(root: Path | str, role: str, name: str | None = None) -> Credentials:
    """A client's credentials from the key directory ``root`` (``role``: learner, actor or monitor)."""
    client = client_keys(root, role, name)
    signer = signing_key(root, client.name) if role == "learner" else None
    pins = pinned_learners(root)
    if role == "actor" and not pins:
        raise KeysError(f"{folder(root, 'learner')} holds no learner signing key (NAME.sign.pub) for actors to pin")
    return Credentials(client, pins, signer)


def check_name(name: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise KeysError(f"key name {name!r}: use 1-64 letters, digits, '_', '.' or '-' (starting with a letter/digit)")
    return name


def folder(root: Path | str, role: str) -> Path:
    if role not in FOLDERS:
        raise KeysError(f"key role must be one of {', '.join(KEY_ROLES)}, got {role!r}")
    return Path(root) / FOLDERS[role]


def new_key(root: Path | str, role: str, name: str) -> list[Path]:
    """Make the keys of ``role`` ``name`` under ``root``; returns the files written. Never overwrites."""
    where = folder(root, role)
    check_name(name)
    if role == "broker" and list(where.glob(f"*{PUBLIC}")):
        raise KeysError(f"{where} already holds a broker key; one broker key per key directory")
    suffixes = (PUBLIC, SECRET, SIGN_PUBLIC, SIGN_SECRET) if role == "learner" else (PUBLIC, SECRET)
    for suffix in suffixes:
        if (where / f"{name}{suffix}").exists():
            raise KeysError(f"{where / (name + suffix)} exists: keys are never overwritten (remove it to replace it)")
    where.mkdir(parents=True, exist_ok=True)
    old_umask = os.umask(0o077)  # the secret is private from its first byte (zmq.auth writes with the umask)
    try:
        public, secret = zmq.auth.create_certificates(str(where), name)
    finally:
        os.umask(old_umask)
    os.chmod(public, 0o644)
    written = [Path(public), Path(secret)]
    if role == "learner":
        written += _new_signing_pair(where, name)
    return written


def _new_signing_pair(where: Path, name: str) -> list[Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    private = Ed25519PrivateKey.generate()
    secret_path, public_path = where / f"{name}{SIGN_SECRET}", where / f"{name}{SIGN_PUBLIC}"
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(secret_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(pem)
    public_path.write_bytes(
        private.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return [public_path, secret_path]


def list_keys(root: Path | str) -> list[KeyInfo]:
    """Every key under ``root``, by role then name."""
    out = []
    for role in KEY_ROLES:
        where = folder(root, role)
        for public in sorted(where.glob(f"*{PUBLIC}")):
            name = public.name[: -len(PUBLIC)]
            key, _ = _load(public)
            out.append(
                KeyInfo(
                    role,
                    name,
                    key.decode(),
                    (where / f"{name}{SECRET}").exists(),
                    (where / f"{name}{SIGN_PUBLIC}").exists(),
                )
            )
    return out


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise KeysError(f"{path}: not a readable zmq.auth key file ({exc})") from None
    return public, secret


def _only(root: Path | str, role: str, name: str | None, suffix: str) -> Path:
    """The file of ``role`` ``name`` (or the only one of that role with ``suffix``, when no name is given)."""
    where = folder(root, role)
    if name is not None:
        path = where / f"{check_name(name)}{suffix}"
        if not path.exists():
            raise KeysError(f"no {role} key {name!r}: {path} is missing (zddrl keys new {role} {name})")
        return path
    found = sorted(where.glob(f"*{suffix}"))
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        hint = f"zddrl keys new {role} NAME" if not found else "choose one with --key NAME"
        raise KeysError(f"{where} holds {what} {role} key{'' if suffix == PUBLIC else ' secret'}s ({hint})")
    return found[0]


def key_files(root: Path | str) -> tuple[tuple[str, int, float], ...]:
    """Every public key file under ``root`` with its size and mtime: compared to see whether the lists changed."""
    out = []
    for role in KEY_ROLES:
        for path in sorted(folder(root, role).glob(f"*{PUBLIC}")):
            try:
                st = path.stat()
            except OSError:  # removed while we listed
                continue
            out.append((str(path), st.st_size, st.st_mtime))
    return tuple(out)


def public_key(root: Path | str, role: str, name: str | None = None) -> bytes:
    """The CURVE public key (Z85) of ``role`` ``name`` (or the only one of that role): a server a client connects
    to that is not the broker (a learner to its replay services)."""
    public, _ = _load(_only(root, role, name, PUBLIC))
    return public


def client_keys(root: Path | str, role: str, name: str | None = None, server: bytes | None = None) -> ClientKeys:
    """This host's keys as a client of ``role`` (its secret must be here) and the broker's public key (``server``,
    or the only one in ``broker/``)."""
    secret_path = _only(root, role, name, SECRET)
    public, secret = _load(secret_path)
    if secret is None:
        raise KeysError(f"{secret_path} holds no secret key")
    if server is None:
        server, _ = _load(_only(root, "broker", None, PUBLIC))
    return ClientKeys(role, secret_path.name[: -len(SECRET)], public, secret, server)


def server_keys(root: Path | str, name: str | None = None) -> ServerKeys:
    """The broker's pair (``broker/NAME``, or the only broker secret there) and every client's public key, each
    with its role and name. A public key listed under two roles (or twice) is an error: a member's role must
    follow from its key alone."""
    path = _only(root, "broker", name, SECRET)
    public, secret = _load(path)
    if secret is None:
        raise KeysError(f"{path} holds no broker secret key")
    allowed: dict[bytes, tuple[str, str]] = {}
    for info in list_keys(root):
        if info.role == "broker":
            continue
        key = info.public.encode()
        if key in allowed:
            raise KeysError(f"one public key is listed as {allowed[key]} and as {(info.role, info.name)}")
        allowed[key] = (info.role, info.name)
    return ServerKeys(public, secret, allowed, path.name[: -len(SECRET)])


def relay_credentials(root: Path | str, name: str | None = None) -> Credentials:
    """A relay's credentials towards its upstream: its relay key (the only secret in ``relays/``) and the
    upstream's public key, which is the one broker public key in ``broker/`` besides the relay's own pair
    (``broker/NAME``, or the only broker secret there). A directory whose ``broker/`` holds no other broker key
    would make the relay serve its actors with its upstream's own secret: refused (docs/security.md, "Relays")."""
    own = server_keys(root, name)
    where = folder(root, "broker")
    others = [p for p in sorted(where.glob(f"*{PUBLIC}")) if p.name != f"{own.name}{PUBLIC}"]
    if len(others) != 1:
        found = f"{len(others)} ({', '.join(p.name for p in others)})" if others else "none"
        raise KeysError(
            f"a relay's {where} holds its own broker pair ({own.name}, its actors hold the public file) and its "
            f"upstream's public key; other broker keys there: {found}. Make the relay a pair of its own (zddrl keys "
            "new broker NAME in its directory) and copy the upstream's broker/NAME.key beside it, never its secret"
        )
    upstream, _ = _load(others[0])
    if upstream == own.public:
        raise KeysError(f"{others[0]} is this relay's own broker key: a relay serves with a pair of its own")
    return Credentials(client_keys(root, "relay", None, upstream), pinned_learners(root))


def signing_key(root: Path | str, name: str | None = None) -> tuple[str, Ed25519PrivateKey]:
    """A learner's Ed25519 secret key (name, key): it signs parameter versions and run specs."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = _only(root, "learner", name, SIGN_SECRET)
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise KeysError(f"{path}: not a readable Ed25519 PEM key ({exc})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeysError(f"{path} is not an Ed25519 key")
    return path.name[: -len(SIGN_SECRET)], key


def pinned_learners(root: Path | str) -> dict[str, Ed25519PublicKey]:
    """The learners' Ed25519 public keys by name: the only signers whose parameters and runs are accepted."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    out = {}
    for path in sorted(folder(root, "learner").glob(f"*{SIGN_PUBLIC}")):
        try:
            key = serialization.load_pem_public_key(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise KeysError(f"{path}: not a readable Ed25519 PEM public key ({exc})") from None
        if not isinstance(key, Ed25519PublicKey):
            raise KeysError(f"{path} is not an Ed25519 public key")
        out[path.name[: -len(SIGN_PUBLIC)]] = key
    return out


def sign(key: Ed25519PrivateKey, payload: bytes) -> bytes:
    return key.sign(payload)


def verified(pins: dict[str, Ed25519PublicKey], signer: str, payload: bytes, signature: bytes) -> bool:
    """Whether ``signature`` over ``payload`` is ``signer``'s, and ``signer`` is pinned here."""
    from cryptography.exceptions import InvalidSignature

    key = pins.get(signer)
    if key is None:
        return False
    try:
        key.verify(signature, payload)
        return True
    except InvalidSignature:
        return False
