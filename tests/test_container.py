"""deploy/container/Containerfile for real: the image built with podman from this checkout and a CartPole run in it,
which must reach its target. Opt-in (building takes minutes): runs only with ZDDRL_CONTAINER_TEST=1 and a podman
that works, skipped with the reason otherwise.

Where no image registry is reachable the base image is made from Debian's packages (debootstrap, root only;
ZDDRL_DEBIAN_MIRROR names the mirror) and imported as localhost/debian:bookworm-slim, then reused;
ZDDRL_CONTAINER_BASE names another base. Where download.pytorch.org is unreachable, torch's CPU wheel comes from a
local folder: ZDDRL_CONTAINER_TORCH_WHEELS, else the first folder of PIP_FIND_LINKS that holds a torch wheel.
docs/deploying.md has the podman settings it needs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.serial,
    pytest.mark.skipif(
        os.environ.get("ZDDRL_CONTAINER_TEST") != "1",
        reason="building an image takes minutes: set ZDDRL_CONTAINER_TEST=1 to run it",
    ),
]

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "deploy" / "container" / "Containerfile"
LOCAL_BASE = "localhost/debian:bookworm-slim"
IMAGE = "localhost/zddrl:test"
SECURITY = "deb http://deb.debian.org/debian-security bookworm-security main"  # the official image's apt sources
# Where the machine trusts a TLS-intercepting proxy, its CA reaches the image's ca-certificates (and so pip).
LOCAL_CAS = Path("/usr/local/share/ca-certificates")


def _podman() -> str:
    podman = shutil.which("podman")
    if podman is None:
        pytest.skip("podman is not installed (Debian: apt-get install podman)")
    done = subprocess.run([podman, "info"], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        pytest.skip(f"podman does not work here: {done.stderr.strip()[-300:]}")
    return podman


def _has_image(podman: str, name: str) -> bool:
    return subprocess.run([podman, "image", "exists", name], timeout=60).returncode == 0


def _base(podman: str, tmp: Path) -> str:
    """The base image: ZDDRL_CONTAINER_BASE, or Debian bookworm made with debootstrap once and kept."""
    if name := os.environ.get("ZDDRL_CONTAINER_BASE"):
        return name
    if _has_image(podman, LOCAL_BASE):
        return LOCAL_BASE
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        pytest.skip(f"no {LOCAL_BASE}, and making it needs root and debootstrap (or set ZDDRL_CONTAINER_BASE)")
    rootfs, mirror = tmp / "rootfs", os.environ.get("ZDDRL_DEBIAN_MIRROR", "http://deb.debian.org/debian")
    try:
        made = subprocess.run(["debootstrap", "--variant=minbase", "bookworm", str(rootfs), mirror],
                              capture_output=True, text=True, timeout=1800)  # fmt: skip
        assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
        lines = [f"deb {mirror} {suite} main" for suite in ("bookworm", "bookworm-updates")] + [SECURITY]
        (rootfs / "etc" / "apt" / "sources.list").write_text("\n".join(lines) + "\n")
        for leftover in [*rootfs.glob("var/cache/apt/archives/*.deb"), *rootfs.glob("var/lib/apt/lists/*_*")]:
            leftover.unlink()  # debootstrap's downloads: the image's own apt-get update fetches the lists again
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run([podman, "import", "-", LOCAL_BASE], stdin=tar.stdout, capture_output=True,
                                  text=True, timeout=600)  # fmt: skip
        assert tar.wait(timeout=60) == 0 and imported.returncode == 0, imported.stderr[-2000:]
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)
    return LOCAL_BASE


def _torch_wheels() -> Path | None:
    """A local folder holding torch's wheel, for a machine that cannot reach download.pytorch.org."""
    if folder := os.environ.get("ZDDRL_CONTAINER_TORCH_WHEELS"):
        return Path(folder)
    for entry in os.environ.get("PIP_FIND_LINKS", "").split():
        if Path(entry).is_dir() and any(Path(entry).glob("torch-*.whl")):
            return Path(entry)
    return None


def _build(podman: str, base: str) -> None:
    command = [podman, "build", "-f", str(RECIPE), "--build-arg", f"BASE={base}", "-t", IMAGE]
    if wheels := _torch_wheels():
        command += ["-v", f"{wheels}:/wheels:ro", "--build-arg", "TORCH_FIND_LINKS=/wheels"]
    if LOCAL_CAS.is_dir() and any(LOCAL_CAS.iterdir()):
        command += ["-v", f"{LOCAL_CAS}:{LOCAL_CAS}:ro"]
    built = subprocess.run([*command, str(ROOT)], capture_output=True, text=True, timeout=2400)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]


@pytest.mark.timeout(3600)
def test_the_image_builds_and_trains_cartpole_to_its_target(tmp_path: Path) -> None:
    podman = _podman()
    _build(podman, _base(podman, tmp_path))
    name = f"zddrl-test-{uuid.uuid4().hex[:8]}"
    try:
        run = subprocess.run([podman, "run", "--rm", "--name", name, IMAGE, "train", "examples/cartpole_ppo.toml"],
                             capture_output=True, text=True, timeout=600)  # fmt: skip
    finally:
        subprocess.run([podman, "rm", "-f", "--ignore", name], capture_output=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads([line for line in run.stdout.splitlines() if line.startswith("{")][-1])
    assert summary["reached"] is True, summary
