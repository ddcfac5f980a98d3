"""A key directory as Kubernetes Secrets (`zddrl keys kubernetes`), laid out so that each pod mounts only what its
role needs (deploy/kubernetes/): per key folder (``broker/``, ``learners/``, ...) one Secret with every file, the
secret ones included (``zddrl-broker``), and one with its public files only (``zddrl-broker-public``). A pod mounts
its own folder's full Secret and the public ones of the roles it talks to, at ``/keys/FOLDER``: the same layout
as the directory (docs/security.md), so ``--keys /keys`` reads it as it is.

The YAML is written by hand: flat string maps of base64 data, nothing a YAML library would do differently.
"""

from __future__ import annotations

import base64
from pathlib import Path

from zddrl.keys import FOLDERS

SECRET_SUFFIXES = (".key_secret", ".sign")
"""Files that must stay on their role's host: a CURVE secret key, an Ed25519 signing key."""


def secret_manifests(keys_dir: str | Path, namespace: str = "zddrl") -> str:
    """The Secrets of every key folder in ``keys_dir`` as one multi-document YAML; ValueError if it holds none."""
    root = Path(keys_dir)
    docs = []
    for folder in FOLDERS.values():
        files = sorted(p for p in (root / folder).glob("*") if p.is_file()) if (root / folder).is_dir() else []
        if not files:
            continue
        docs.append(_secret(f"zddrl-{folder}", namespace, folder, files, "every key of the folder"))
        public = [p for p in files if p.suffix not in SECRET_SUFFIXES]
        docs.append(_secret(f"zddrl-{folder}-public", namespace, folder, public, "its public keys only"))
    if not docs:
        raise ValueError(f"{root} holds no keys (make them with: zddrl keys new ROLE NAME --keys {root})")
    return "---\n".join(docs)


def _secret(name: str, namespace: str, folder: str, files: list[Path], what: str) -> str:
    lines = [
        f"# {folder}/: {what}",
        "apiVersion: v1",
        "kind: Secret",
        "type: Opaque",
        "metadata:",
        f"  name: {name}",
        f"  namespace: {namespace}",
        "  labels:",
        "    app.kubernetes.io/name: zddrl",
        "data:",
    ]
    lines += [f"  {p.name}: {base64.b64encode(p.read_bytes()).decode()}" for p in files]
    if not files:
        lines[-1] = "data: {}"
    return "\n".join(lines) + "\n"
