"""Every command block of README.md and ``docs/*.md`` is either run here or says why not.

The convention is in docs/contributing.md ("Commands in the docs are tested") and
:mod:`tests.docs.blocks`. Two parts:

- **Cheap** (no cluster, always runs): every command block carries a marker; every
  ``tested`` id is one this runner knows, and every id it knows is in the docs; every
  relative link resolves to a file (and its ``#anchor`` to a heading); every ``make
  <target>`` the docs name is a Makefile target; the blocks that need no cluster (the entry
  points' ``--help``) run, with ``.venv/bin`` on ``PATH``.
- **On a real node** (``node``, ``slow``, ``sampled``): the quick start of README.md, then
  ``kubectl rota``, an upgrade, an uninstall, the install of docs/install.md and a second
  uninstall, in one shell, in that order, with the release chart from this repository.
  They run on a local cluster and a real node of their own (not the session's), so the
  docs' own names (namespace ``rota-system``, release ``rota``, the DeviceClass the chart
  creates) are used unchanged. The node has **no GPU**: the fake NVML backend answers for
  an H200 and **rota's engine simulator stands in for vLLM** (the simulator example
  replaces ``vllm-two-models.yaml``). :data:`SUBSTITUTIONS` is every change made to the
  docs' text, and :data:`BETWEEN` every command the runner adds between blocks.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.docs.blocks import ROOT, Block, all_blocks, anchors_of, doc_files, marked, prose_of

LOCAL = ("kubectl-rota-help", "component-help")
"""Blocks run without a cluster."""
ON_NODE = ("quickstart", "quickstart-requests", "kubectl-rota", "upgrade", "uninstall",
           "install-helm", "uninstall")
"""Blocks run on the real node, in this order (the uninstall twice)."""
KNOWN = frozenset(LOCAL) | frozenset(ON_NODE)

PENDING_FILES = frozenset({"docs/scale.md"})
"""Files the docs link to that a change of their own adds; accepted while absent."""

SIMULATOR_MODELS = {"Qwen/Qwen2.5-7B-Instruct": "org/model-a",
                    "Qwen/Qwen2.5-Coder-3B-Instruct": "org/model-b"}


# -- the cheap part ----------------------------------------------------------------------


def _command_blocks() -> list[Block]:
    return [b for b in all_blocks() if b.is_commands]


def test_every_command_block_is_marked() -> None:
    unmarked = [b.where for b in _command_blocks() if b.marker is None]
    assert not unmarked, f"command blocks without a tested/not-tested marker: {unmarked}"


def test_not_tested_blocks_say_why() -> None:
    silent = [b.where for b in all_blocks() if b.marker == "not-tested" and not b.value]
    assert not silent, f"not-tested blocks without a reason: {silent}"


def test_every_tested_block_is_known_to_the_runner() -> None:
    unknown = [f"{b.where} ({b.value})" for b in all_blocks()
               if b.marker == "tested" and b.value not in KNOWN]
    assert not unknown, f"tested blocks this runner does not know: {unknown}"


def test_every_block_the_runner_knows_is_in_the_docs() -> None:
    missing = sorted(block_id for block_id in KNOWN if not marked(block_id))
    assert not missing, f"runner ids no doc marks any more: {missing}"


def test_every_tested_id_marks_one_block() -> None:
    ids = [b.value for b in all_blocks() if b.marker == "tested"]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    assert not repeated, f"ids marking several blocks: {repeated}"


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _links() -> Iterator[tuple[Path, str]]:
    for path in doc_files():
        prose = re.sub(r"`[^`\n]*`", "", prose_of(path))  # no links inside inline code
        for target in _LINK.findall(prose):
            yield path, target


def test_relative_links_resolve() -> None:
    broken: list[str] = []
    for path, target in _links():
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}: {target}"
        if not resolved.exists():
            if resolved.relative_to(ROOT).as_posix() not in PENDING_FILES:
                broken.append(f"{where} (no such file)")
            continue
        if anchor and resolved.suffix == ".md" and anchor not in anchors_of(resolved):
            broken.append(f"{where} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_links_are_found() -> None:
    """The link check reads something (a parser that finds nothing passes anything)."""
    targets = {target for _, target in _links()}
    assert "docs/install.md#requirements" in targets


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, flags=re.MULTILINE))


def _targets_named() -> set[tuple[str, str]]:
    named: set[tuple[str, str]] = set()
    pattern = re.compile(r"(?:^|[\s`(=;&|])make ([a-z][\w-]*)")
    for path in doc_files():
        code = re.findall(r"`([^`\n]+)`", prose_of(path))
        code += [b.text for b in all_blocks() if b.path == path]
        for piece in code:
            for line in piece.splitlines():
                for target in pattern.findall(" " + line):
                    named.add((str(path.relative_to(ROOT)), target))
    return named


def test_every_make_target_named_exists() -> None:
    targets = _make_targets()
    assert {"demo", "test"} <= targets
    missing = sorted(f"{where}: make {target}" for where, target in _targets_named()
                     if target not in targets)
    assert not missing, f"make targets the Makefile lacks: {missing}"


def test_make_targets_are_found() -> None:
    assert ("README.md", "demo") in _targets_named()


def _venv_bin() -> Path:
    return Path(sys.executable).parent


@pytest.mark.parametrize("block_id", LOCAL)
def test_local_blocks_run(block_id: str) -> None:
    (block,) = marked(block_id)
    env = {**os.environ, "PATH": f"{_venv_bin()}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"{block.where}:\n{done.stdout}\n{done.stderr}"
    assert "usage" in done.stdout.lower()


# -- on a real node -----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Substitutions:
    node: str
    port: int
    timeout: str = "--timeout=5m"

    def table(self) -> list[tuple[str, str]]:
        """Every change the runner makes to the docs' text, in order."""
        return [
            ("<gpu-node>", self.node),
            ("manifests/examples/vllm-two-models.yaml", "manifests/examples/two-models.yaml"),
            *SIMULATOR_MODELS.items(),
            ("8080:80", f"{self.port}:80"),
            ("localhost:8080", f"localhost:{self.port}"),
            ("--timeout=30m", self.timeout),
        ]

    def apply(self, text: str) -> str:
        for old, new in self.table():
            text = text.replace(old, new)
        return text


def BETWEEN(port: int) -> dict[str, str]:
    """What the runner adds after a block (a user would see it happen before going on)."""
    ready = "\n".join(f"kubectl -n rota-system rollout status {what} --timeout=5m"
                      for what in ("daemonset/rota-driver", "daemonset/rota-controller",
                                   "deployment/rota-gateway"))
    return {
        # kubectl prints "Forwarding from 127.0.0.1:<port>" before a user types curl.
        "quickstart": f"for _ in $(seq 150); do (exec 3<>/dev/tcp/127.0.0.1/{port}) "
                      "2>/dev/null && break; sleep 0.2; done",
        "uninstall": "kubectl -n rota-system wait --for=delete pod --all --timeout=5m",
        "install-helm": ready,
    }


_HELM_WRAPPER = """#!/bin/sh
# helm, with the fake GPU's values added to install and upgrade (the node has no GPU).
case "$1" in
  install|upgrade) exec {helm} "$@" --values {values} ;;
  *) exec {helm} "$@" ;;
esac
"""


def _script(subs: Substitutions) -> str:
    between = BETWEEN(subs.port)
    lines = ["set -euo pipefail", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]
    for block_id in ON_NODE:
        (block,) = marked(block_id)
        text = subs.apply(block.text)
        lines.append(f"echo '### {block_id} ({block.where})'")
        lines.append("sed 's/^/$ /' <<'ROTA_DOCS_BLOCK'\n" + text + "ROTA_DOCS_BLOCK")
        lines.append(text.rstrip("\n"))
        lines.append(f"echo '### runner after {block_id}'")
        if block_id in between:
            lines.append(between[block_id])
    lines.append("echo '### done'")
    return "\n".join(lines) + "\n"


def _sections(output: str) -> dict[str, str]:
    parts: dict[str, str] = {}
    current = ""
    for line in output.splitlines():
        heading = re.match(r"^### (\S+)", line)
        if heading and not line.startswith("### runner"):
            current = heading.group(1)
            parts[current] = parts.get(current, "")
            continue
        if line.startswith("### runner"):
            current = ""
            continue
        if current:
            parts[current] += line + "\n"
    return parts


@pytest.mark.cluster
@pytest.mark.node
@pytest.mark.slow
@pytest.mark.sampled
def test_quick_start_and_admin_commands_on_a_real_node(tmp_path: Path) -> None:
    from e2e.cluster import LocalCluster
    from e2e.cluster.binaries import locate
    from e2e.cluster.realnode import FAKE_GPU_DEV_ROOT, RealNode, RealNodeOptions
    from e2e.harness.rota_node import build_rota_images
    from e2e.release.chart import tools_bin
    from tests.real_node import MISSING

    if os.geteuid() != 0 or MISSING:
        pytest.skip(f"a real node needs root and {', '.join(MISSING) or 'nothing missing'}")
    k8s_bin = locate()
    images = build_rota_images()
    cluster = LocalCluster()
    node: RealNode | None = None
    try:
        cluster.start()
        node = RealNode(cluster, "gpu-node-1", images, bin_dir=k8s_bin,
                        options=RealNodeOptions(), index=200)
        node.start()
        assert node.namespace is not None
        # The chart mounts a device root other than /dev with HostToContainer propagation,
        # which needs a shared mount (as systemd makes every mount).
        subprocess.run(node.namespace.enter(["mount", "--make-rshared", "/var/lib"],
                                            network=False), check=True, timeout=30)
        output = _run_on_node(tmp_path, cluster.kubeconfig, node.name, k8s_bin, tools_bin(),
                              fake_dev_root=FAKE_GPU_DEV_ROOT)
    finally:
        if node is not None:
            node.stop()
        cluster.cleanup()
    print("\n" + output)
    sections = _sections(output)
    assert "done" in sections, output[-4000:]
    answers = sections["quickstart-requests"]
    assert answers.count('"choices"') == 2, answers
    # The pods' state label follows the switch a moment later (it may still say
    # "switching" right after the answer); the GPU Lease, read by kubectl rota, says awake.
    status = sections["kubectl-rota"]
    assert "org/model-b" in status
    assert " awake " in status, status


def _run_on_node(tmp: Path, kubeconfig: Path, node: str, k8s_bin: Path, tools: Path, *,
                 fake_dev_root: str) -> str:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").symlink_to(k8s_bin / "kubectl")
    (bin_dir / "kubectl-rota").symlink_to(_venv_bin() / "kubectl-rota")
    values = tmp / "fake-gpu-values.yaml"
    proc_dir = "/var/lib/kubelet/plugins/gpu.rota.dev/fake-nvml"
    values.write_text(
        "nvml: {fakeFixture: h200}\n"
        f"cdi: {{devRoot: {fake_dev_root}}}\n"
        "driver:\n  extraEnv: [{name: ROTA_FAKE_NVML_PROC_DIR, "
        f"value: {proc_dir}}}]\n"
        "gateway: {replicas: 1}\n")
    helm = bin_dir / "helm"
    helm.write_text(_HELM_WRAPPER.format(helm=shlex.quote(str(tools / "helm")),
                                         values=shlex.quote(str(values))))
    helm.chmod(0o755)
    subs = Substitutions(node=node, port=_free_port())
    script = tmp / "docs.sh"
    script.write_text(_script(subs))
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
           "HOME": str(tmp), "KUBECONFIG": str(kubeconfig),
           **{f"HELM_{kind}_HOME": str(tmp / f"helm-{kind.lower()}")
              for kind in ("CACHE", "CONFIG", "DATA")}}
    log = tmp / "docs.log"
    with log.open("w") as out:
        done = subprocess.run(["bash", str(script)], cwd=ROOT, env=env, stdout=out,
                              stderr=subprocess.STDOUT, timeout=1500, check=False)
    text = log.read_text()
    keep = os.environ.get("ROTA_DOCS_TRANSCRIPT")
    if keep:
        shutil.copy(log, keep)
    assert done.returncode == 0, f"exit {done.returncode}:\n{text[-6000:]}"
    return text
