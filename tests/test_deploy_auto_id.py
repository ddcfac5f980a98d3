"""deploy/kubernetes/actors-deployment.yaml, the actors as a Deployment with ids from the broker (`--actor-id auto`):
valid against Kubernetes 1.30's schemas, its command line accepted by `zddrl actor` with the environment it sets,
the same key folders mounted as actors.yaml's StatefulSet, and one of the two in the kustomization at a time."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
import yaml

from zddrl.cli import main

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="needs kubernetes-validate (test extra)")

KUBE = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"


def only(name: str, kind: str) -> dict:
    docs = [d for d in yaml.safe_load_all((KUBE / name).read_text()) if d and d["kind"] == kind]
    assert len(docs) == 1, name
    return docs[0]


def test_the_actors_deployment_is_valid_and_asks_the_broker_for_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    deployment = only("actors-deployment.yaml", "Deployment")
    kubernetes_validate.validate(deployment, "1.30.0", strict=True)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {"ZDDRL_ACTOR_ID": "auto"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    command = main.get_command(click.Context(main), "actor")
    assert command is not None
    ctx = command.make_context("actor", container["args"][1:])
    assert ctx.params["actor_id"] == "auto"

    statefulset = only("actors.yaml", "StatefulSet")
    (theirs,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert container["volumeMounts"] == theirs["volumeMounts"]
    assert deployment["spec"]["template"]["spec"]["volumes"] == statefulset["spec"]["template"]["spec"]["volumes"]
    assert deployment["metadata"]["name"] == statefulset["metadata"]["name"]  # one or the other, never both
    resources = yaml.safe_load((KUBE / "kustomization.yaml").read_text())["resources"]
    assert ("actors.yaml" in resources) != ("actors-deployment.yaml" in resources)
