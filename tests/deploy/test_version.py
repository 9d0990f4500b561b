"""One version: ``src/gpushare/_version.py``. Everything else that states it must agree:
the package metadata (pyproject reads the file), ``gpushare --version``, the exporter's
``gpushare_build_info``, and every gpushare image tag in deploy/ and in the docs."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpushare._version import __version__
from tests.deploy.test_deploy import by_kind, render
from tests.support import REPO

IMAGE = "ghcr.io/gpushare/gpushare"
# An image reference to gpushare with a version-like tag, anywhere in a text file
# (`image:` lines, `docker build -t ...:0.1.0`, `set image gpushare=REGISTRY/gpushare:0.1.0`).
TAGGED = re.compile(r"\bgpushare:(v?\d[\w.+-]*)")
REINSTALL = "after a version bump, reinstall (make .venv/.installed, or pip install -e .)"


def _walk(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k, v
            yield from _walk(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk(v)


def yaml_images(path: Path) -> list[str]:
    """Every ``image:`` value and kustomize ``images:`` entry for gpushare in one file."""
    out = []
    for doc in yaml.safe_load_all(path.read_text()):
        for key, value in _walk(doc):
            if key == "image" and isinstance(value, str) and value.startswith(IMAGE):
                out.append(value)
            if key == "images" and isinstance(value, list):
                out += [
                    f"{e.get('newName', e['name'])}:{e.get('newTag', '')}"
                    for e in value
                    if e.get("name") == "gpushare"
                ]
    return out


def test_the_version_is_a_release_number():
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?", __version__), __version__


def test_pyproject_reads_the_version_from_one_file():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"], "the version is written in _version.py only"
    assert project["project"]["dynamic"] == ["version"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "gpushare._version.__version__"


def test_package_metadata_says_the_same():
    assert importlib.metadata.version("gpushare") == __version__, REINSTALL


def test_the_command_line_says_the_same():
    exe = Path(sys.executable).parent / "gpushare"  # the installed console script
    for cmd in ([str(exe)], [sys.executable, "-m", "gpushare"]):
        r = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == f"gpushare {__version__}"


def test_the_exporter_says_the_same():
    from gpushare.node.observe.metrics import registry_for
    from gpushare.status import NodeInfo, NodeStatus

    empty = NodeStatus(node=NodeInfo(pid=0, started=0.0, config=""), gpus=[])
    (info, *_) = registry_for(lambda: empty).collect()
    assert info.name == "gpushare_build_info"
    assert info.samples[0].labels["version"] == __version__


@pytest.mark.parametrize("overlay", ["plain", "kai"])
def test_the_daemonset_runs_this_version(overlay):
    ds = by_kind(render(overlay))["DaemonSet"]
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    assert c["image"] == f"{IMAGE}:{__version__}", "the kustomize base's newTag"


def test_every_gpushare_image_in_deploy_is_this_version():
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "deploy").rglob("*.yaml")):
        if images := yaml_images(path):
            found[str(path.relative_to(REPO))] = images
    # The kustomize base and the examples that run gpushare's image: the check sees them.
    assert "deploy/kubernetes/base/kustomization.yaml" in found
    assert "deploy/examples/inference.yaml" in found
    want = f"{IMAGE}:{__version__}"
    wrong = {p: bad for p, images in found.items() if (bad := [i for i in images if i != want])}
    assert not wrong, f"set these to {__version__} (src/gpushare/_version.py): {wrong}"


def test_every_tag_written_in_deploy_and_docs_is_this_version():
    files = [
        *(p for p in (REPO / "deploy").rglob("*") if p.is_file()),
        *(REPO / "docs").rglob("*.md"),
        REPO / "README.md",
    ]
    tags = {
        f"{p.relative_to(REPO)}:{n}": m.group(1)
        for p in files
        for n, line in enumerate(p.read_text().splitlines(), 1)
        for m in TAGGED.finditer(line)
    }
    assert "deploy/Dockerfile:2" in tags  # the build command in its header
    wrong = {where: tag for where, tag in tags.items() if tag != __version__}
    assert not wrong, f"set these to {__version__} (src/gpushare/_version.py): {wrong}"
