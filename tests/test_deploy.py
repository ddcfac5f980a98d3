"""deploy/kubernetes/: every manifest valid against the published schemas of Kubernetes 1.30 (kubernetes-validate,
strict: no unknown field), the Secrets `zddrl keys kubernetes` writes among them, every zddrl command line in them
accepted by zddrl's own CLI, each pod mounting the key folders its role reads, and the kustomization's copies of
the example config and broker profile equal to their originals."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from zddrl.cli import main
from zddrl.keys import new_key
from zddrl.ops.kube_secrets import secret_manifests

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (test extra)")

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
VERSION = "1.30.0"
MANIFESTS = ("namespace.yaml", "broker.yaml", "learner.yaml", "actors.yaml")
FOLDERS_OF_ROLE = {
    "broker": {"broker", "learners", "actors", "monitors"},  # its secret, every client's public key
    "learner": {"learners", "broker"},
    "actor": {"actors", "broker", "learners"},  # the learners' signing keys are pinned
}


def documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def all_manifests() -> list[dict[str, Any]]:
    return [doc for name in MANIFESTS for doc in documents((KUBE / name).read_text())]


def keys_dir(tmp_path: Path) -> Path:
    for role, name in (("broker", "hub"), ("learner", "trainer"), ("actor", "fleet"), ("monitor", "ops")):
        new_key(tmp_path / "keys", role, name)
    return tmp_path / "keys"


def test_every_manifest_is_valid_for_kubernetes_1_30(tmp_path: Path) -> None:
    docs = all_manifests() + documents(secret_manifests(keys_dir(tmp_path)))
    assert {d["kind"] for d in docs} >= {"Namespace", "Deployment", "Service", "Job", "StatefulSet", "Secret"}
    for doc in docs:
        kubernetes_validate.validate(doc, VERSION, strict=True)  # raises ValidationError, naming the field


def test_the_secrets_hold_each_folder_whole_and_public(tmp_path: Path) -> None:
    secrets = {d["metadata"]["name"]: d for d in documents(secret_manifests(keys_dir(tmp_path)))}
    assert set(secrets["zddrl-broker"]["data"]) == {"hub.key", "hub.key_secret"}
    assert set(secrets["zddrl-broker-public"]["data"]) == {"hub.key"}
    assert set(secrets["zddrl-learners-public"]["data"]) == {"trainer.key", "trainer.sign.pub"}
    mounted = {v["secret"]["secretName"] for d in all_manifests() for v in _pod(d).get("volumes", []) if "secret" in v}
    assert mounted <= set(secrets), mounted - set(secrets)


def test_each_pod_mounts_the_key_folders_of_its_role_and_only_its_own_secrets() -> None:
    for doc in all_manifests():
        pod = _pod(doc)
        for container in pod.get("containers", []):
            role = container["args"][0]
            volumes = {v["name"]: v for v in pod["volumes"]}
            keys = {
                m["mountPath"].removeprefix("/keys/"): volumes[m["name"]]["secret"]["secretName"]
                for m in container["volumeMounts"]
                if m["mountPath"].startswith("/keys/")
            }
            assert set(keys) == FOLDERS_OF_ROLE[role], (role, keys)
            full = {folder for folder, secret in keys.items() if not secret.endswith("-public")}
            assert full == {"broker" if role == "broker" else f"{role}s"}, (role, full)  # one secret folder: its own


def test_every_zddrl_command_line_in_the_manifests_is_accepted() -> None:
    lines = [c["args"] for d in all_manifests() for c in _pod(d).get("containers", [])]
    lines += [p["exec"]["command"][1:] for d in all_manifests() for c in _pod(d).get("containers", [])
              for p in (c.get("readinessProbe"), c.get("livenessProbe")) if p]  # fmt: skip
    assert len(lines) >= 5
    for args in lines:
        args = [re.sub(r"\$\(\w+\)", "0", a) for a in args]  # $(ACTOR_ID): Kubernetes fills it in
        command = main.get_command(click.Context(main), args[0])
        assert command is not None, args
        command.make_context(args[0], args[1:])  # a wrong option or value is a click error here


def test_the_kustomization_names_files_that_exist_and_its_copies_are_the_originals() -> None:
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    assert set(kustomization["resources"]) == {*MANIFESTS, "secrets.yaml"}
    files = [f for g in kustomization["configMapGenerator"] for f in g["files"]]
    assert all((KUBE / f).is_file() for f in files)
    assert (KUBE / "run.toml").read_text() == (ROOT / "examples" / "cartpole_ppo.toml").read_text()
    assert (KUBE / "cluster.toml").read_text() == (ROOT / "brokers" / "cluster.toml").read_text()


def _pod(doc: dict[str, Any]) -> dict[str, Any]:
    return doc.get("spec", {}).get("template", {}).get("spec", {})


def test_the_container_recipe_copies_files_that_exist_and_runs_zddrl() -> None:
    recipe = (ROOT / "deploy" / "container" / "Containerfile").read_text()
    sources = [s for line in recipe.splitlines() if line.startswith("COPY ") for s in line.split()[1:-1]]
    assert sources and all((ROOT / s).exists() for s in sources), sources
    assert 'ENTRYPOINT ["zddrl"]' in recipe and "download.pytorch.org/whl/cpu" in recipe
