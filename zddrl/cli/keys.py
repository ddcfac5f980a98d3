"""`zddrl keys`: make and list the keys of a closed bus (zddrl/keys.py; docs/security.md)."""

from __future__ import annotations

import json

import click


@click.group()
def keys() -> None:
    """Keys of a closed bus: a CURVE keypair per broker and client, an Ed25519 signing key per learner.

    One directory holds them (docs/security.md): broker/, learners/, actors/, monitors/, relays/, replays/.
    The broker needs its own secret and every client's public key; a client needs its own secret and the
    broker's public key; actors also need the learners' NAME.sign.pub to pin."""


@keys.command("new")
@click.argument("role", type=click.Choice(["broker", "learner", "actor", "monitor", "relay", "replay"]))
@click.argument("name")
@click.option("--keys", "keys_dir", required=True, envvar="ZDDRL_KEYS", type=click.Path(file_okay=False))
def keys_new(role, name, keys_dir) -> None:
    """Make the keys of ROLE NAME in --keys (never overwrites); prints the files written."""
    from zddrl.keys import KeysError, new_key

    try:
        for path in new_key(keys_dir, role, name):
            secret = path.suffix in (".key_secret", ".sign")
            click.echo(f"{path}  ({'secret: keep it on its own host only' if secret else 'public'})")
    except KeysError as exc:
        raise click.UsageError(str(exc)) from None


@keys.command("list")
@click.option("--keys", "keys_dir", required=True, envvar="ZDDRL_KEYS", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def keys_list(keys_dir, as_json) -> None:
    """The keys in --keys: role, name, public key, and whether this directory holds the secret."""
    from zddrl.keys import KeysError, list_keys

    try:
        found = list_keys(keys_dir)
    except KeysError as exc:
        raise click.UsageError(str(exc)) from None
    if as_json:
        click.echo(json.dumps([k._asdict() for k in found], indent=2))
        return
    for k in found:
        extra = ("secret here" if k.secret else "public only") + (", signs" if k.signing else "")
        click.echo(f"{k.role:<8} {k.name:<24} {k.public}  ({extra})")


@keys.command("kubernetes")
@click.option("--keys", "keys_dir", required=True, envvar="ZDDRL_KEYS", type=click.Path(file_okay=False))
@click.option("--namespace", default="zddrl", show_default=True, help="Namespace of the Secrets.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the YAML here (default: stdout).")
def keys_kubernetes(keys_dir, namespace, output) -> None:
    """The keys in --keys as Kubernetes Secrets, one with every file of a key folder (zddrl-broker, ...) and one
    with its public files (zddrl-broker-public, ...): what deploy/kubernetes/ mounts (docs/deploying.md)."""
    from pathlib import Path

    from zddrl.ops.kube_secrets import secret_manifests

    try:
        text = secret_manifests(keys_dir, namespace)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if output:
        path = Path(output)
        path.write_text(text)
        path.chmod(0o600)  # it holds every secret key
        click.echo(f"{path}: {text.count('kind: Secret')} Secrets (secret keys inside: keep the file private)")
    else:
        click.echo(text, nl=False)
