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
- **From one's own registry** (the same marks): what README's quick start says to do where
  rota's image cannot be pulled. ``make release`` (a snapshot of the commit), ``make push``
  signed to a registry on the loopback address, ``make verify``; then the quick start with
  the chart and the image from that registry, as README says, its requests, the uninstall,
  and the chart README's install line (``charts/rota/README.md``, what ``helm show readme``
  prints), the requests again. The node pulls rota's image from the registry (containerd's
  ``hosts.toml``); every container of rota runs the digest the registry serves.

Both run on a local cluster and a real node of their own (not the session's), so the
docs' own names (namespace ``rota-system``, release ``rota``, the DeviceClass the chart
creates) are used unchanged. The node has **no GPU**: the fake NVML backend answers for an
H200 (helm gets its values through a wrapper, and ``--plain-http`` for the registry, which
has no TLS) and **rota's engine simulator stands in for vLLM** (the simulator example,
which carries the vLLM example's readiness probe, replaces ``vllm-two-models.yaml``).
:meth:`Substitutions.table` is every change made to the docs' text, and :func:`BETWEEN`
and :func:`_registry_steps` every command the runner adds between blocks.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.docs.blocks import (
    ROOT,
    Block,
    all_blocks,
    anchors_of,
    blocks_of,
    doc_files,
    marked,
    prose_of,
)

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
ENGINES = "inference"
"""The quick start's engine namespace (the chart README leaves it to the reader)."""
FROM_REGISTRY = ("oci://<your registry>/charts/rota --version <version> "
                 "--set image.repository=<your registry>/rota")
"""What README's quick start says to put in place of ``charts/rota`` for an image and a
chart pushed to one's own registry."""
CHART_README = ROOT / "charts" / "rota" / "README.md"
IMAGE_IDS = ("kubectl -n rota-system get pods -o jsonpath="
             "'{range .items[*]}{range .status.containerStatuses[*]}{.imageID}{\"\\n\"}"
             "{end}{end}'")
"""The runner's print of every rota container's image (``<repository>@<digest>``)."""


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


def test_readme_says_how_to_install_from_ones_own_registry() -> None:
    """The quick start's registry variant the runner walks is the one README states."""
    (quickstart,) = marked("quickstart")
    assert " charts/rota " in quickstart.text
    prose = " ".join(prose_of(ROOT / "README.md").split())
    assert f"`{FROM_REGISTRY}` in place of `charts/rota`" in prose


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
    example: str = "manifests/examples/two-models.yaml"
    """The simulator's example in place of the vLLM one (with the same readiness probe)."""
    registry: str = ""
    """``<your registry>`` (``make push``'s ``REGISTRY``); empty: the chart of the clone."""
    version: str = ""
    """``<version>``: the one pushed to ``registry``."""

    def table(self) -> list[tuple[str, str]]:
        """Every change the runner makes to the docs' text, in order."""
        from_registry = [
            # README's quick start says so for an image of one's own registry
            (" charts/rota ", f" {FROM_REGISTRY} "),
            ("<your registry>", self.registry),
            ("<version>", self.version),
            ("<namespace of your engines>", ENGINES),
        ] if self.registry else []
        return [
            *from_registry,
            ("<gpu-node>", self.node),
            ("manifests/examples/vllm-two-models.yaml", self.example),
            *SIMULATOR_MODELS.items(),
            ("8080:80", f"{self.port}:80"),
            ("localhost:8080", f"localhost:{self.port}"),
            ("--timeout=30m", self.timeout),
        ]

    def apply(self, text: str) -> str:
        for old, new in self.table():
            text = text.replace(old, new)
        return text


def _port_open(port: int) -> str:
    """Wait for the port-forward (kubectl prints "Forwarding from 127.0.0.1:<port>" before a
    user types curl)."""
    return (f"for _ in $(seq 150); do (exec 3<>/dev/tcp/127.0.0.1/{port}) "
            "2>/dev/null && break; sleep 0.2; done")


_ROLLED_OUT = "\n".join(f"kubectl -n rota-system rollout status {what} --timeout=5m"
                        for what in ("daemonset/rota-driver", "daemonset/rota-controller",
                                     "deployment/rota-gateway"))


def BETWEEN(port: int) -> dict[str, str]:
    """What the runner adds after a block (a user would see it happen before going on)."""
    return {
        "quickstart": _port_open(port),
        "uninstall": "kubectl -n rota-system wait --for=delete pod --all --timeout=5m",
        "install-helm": _ROLLED_OUT,
    }


@dataclass(frozen=True)
class Step:
    """One doc block the runner runs (its text substituted), then the runner's own lines."""

    name: str
    where: str
    text: str
    after: str = ""


def _doc_steps(subs: Substitutions) -> list[Step]:
    """:data:`ON_NODE`'s blocks in order, each followed by :func:`BETWEEN`'s lines."""
    between = BETWEEN(subs.port)
    steps = []
    for block_id in ON_NODE:
        (block,) = marked(block_id)
        steps.append(Step(block_id, block.where, subs.apply(block.text),
                          between.get(block_id, "")))
    return steps


_HELM_WRAPPER = """#!/bin/sh
# helm, with the fake GPU's values added to install and upgrade (the node has no GPU){why}.
case "$1" in
  install|upgrade) exec {helm} "$@" --values {values}{extra} ;;
  *) exec {helm} "$@" ;;
esac
"""


def _script(steps: list[Step]) -> str:
    lines = ["set -euo pipefail", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]
    for step in steps:
        lines.append(f"echo '### {step.name} ({step.where})'")
        lines.append("sed 's/^/$ /' <<'ROTA_DOCS_BLOCK'\n" + step.text + "ROTA_DOCS_BLOCK")
        lines.append(step.text.rstrip("\n"))
        lines.append(f"echo '### runner after {step.name}'")
        if step.after:
            lines.append(step.after)
    lines.append("echo '### done'")
    return "\n".join(lines) + "\n"


def _sections(output: str) -> dict[str, str]:
    """The transcript by step: ``<name>`` for a block's output, ``after <name>`` for the
    runner's lines after it."""
    parts: dict[str, str] = {}
    current = ""
    for line in output.splitlines():
        runner = re.match(r"^### runner after (\S+)", line)
        heading = re.match(r"^### (\S+)", line)
        if runner:
            current = f"after {runner.group(1)}"
        elif heading:
            current = heading.group(1)
        else:
            if current:
                parts[current] = parts.get(current, "") + line + "\n"
            continue
        parts.setdefault(current, "")
    return parts


@contextmanager
def _own_node(*, index: int, registry_ports: Sequence[int] = ()) -> Iterator[NodeRun]:
    """A local cluster and a real node of their own (the docs' names unchanged), rota's
    test images on the node, pulling from ``registry_ports`` on the loopback address; both
    stopped on the way out."""
    from e2e.cluster import LocalCluster
    from e2e.cluster.binaries import locate
    from e2e.cluster.realnode import FAKE_GPU_DEV_ROOT, RealNode, RealNodeOptions
    from e2e.harness.rota_node import build_rota_images
    from e2e.release.chart import tools_bin

    k8s_bin = locate()
    images = build_rota_images()
    cluster = LocalCluster()
    node: RealNode | None = None
    try:
        cluster.start()
        node = RealNode(cluster, "gpu-node-1", images, bin_dir=k8s_bin, index=index,
                        options=RealNodeOptions(registry_ports=list(registry_ports)))
        node.start()
        assert node.namespace is not None
        # The chart mounts a device root other than /dev with HostToContainer propagation,
        # which needs a shared mount (as systemd makes every mount).
        subprocess.run(node.namespace.enter(["mount", "--make-rshared", "/var/lib"],
                                            network=False), check=True, timeout=30)
        yield NodeRun(cluster.kubeconfig, node.name, k8s_bin, tools_bin(), FAKE_GPU_DEV_ROOT)
    finally:
        if node is not None:
            node.stop()
        cluster.cleanup()


def _skip_without_a_real_node() -> None:
    from tests.real_node import MISSING

    if os.geteuid() != 0 or MISSING:
        pytest.skip(f"a real node needs root and {', '.join(MISSING) or 'nothing missing'}")


@pytest.mark.cluster
@pytest.mark.node
@pytest.mark.slow
@pytest.mark.sampled
def test_quick_start_and_admin_commands_on_a_real_node(tmp_path: Path) -> None:
    _skip_without_a_real_node()
    subs = Substitutions(node="gpu-node-1", port=_free_port())
    with _own_node(index=200) as node:
        output = node.run(tmp_path, _script(_doc_steps(subs)))
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


def _chart_readme_install() -> Block:
    """The chart README's install block (what ``helm show readme`` prints first)."""
    (block, *_) = [b for b in blocks_of(CHART_README) if b.is_commands]
    assert "helm install rota " in block.text, block.where
    return block


def _registry_steps(subs: Substitutions) -> list[Step]:
    """README's quick start from the registry and its requests; the uninstall; the chart
    README's install line, then the quick start's requests again through a new
    port-forward (the first one's gateway pod is gone)."""
    (quickstart,) = marked("quickstart")
    (requests,) = marked("quickstart-requests")
    (uninstall,) = marked("uninstall")
    install = _chart_readme_install()
    forward = (f"kubectl -n rota-system port-forward svc/rota-gateway {subs.port}:80 &\n"
               + _port_open(subs.port))
    return [
        Step("quickstart", quickstart.where, subs.apply(quickstart.text),
             _port_open(subs.port)),
        Step("quickstart-requests", requests.where, subs.apply(requests.text), IMAGE_IDS),
        Step("uninstall", uninstall.where, subs.apply(uninstall.text),
             BETWEEN(subs.port)["uninstall"] + "\nkill $(jobs -p) 2>/dev/null || true\nwait"),
        Step("chart-readme-install", install.where, subs.apply(install.text),
             f"{_ROLLED_OUT}\n{forward}\n{IMAGE_IDS}"),
        Step("quickstart-requests-again", requests.where, subs.apply(requests.text)),
    ]


@pytest.mark.cluster
@pytest.mark.node
@pytest.mark.slow
@pytest.mark.sampled
def test_quick_start_from_a_verified_registry_image_on_a_real_node(tmp_path: Path) -> None:
    """Issue 32's user without access to rota's image: ``make release`` (a snapshot of the
    commit), ``make push`` signed to a registry of theirs (one on the loopback address,
    plain HTTP), ``make verify``; then README's quick start with the chart and the image
    from that registry, as README says, and the chart README's install line, both word
    for word (:data:`Substitutions` fills in the registry, the version and the engines'
    namespace). The node pulls rota's image from the registry (containerd's
    ``hosts.toml``): every container of rota runs the digest the registry serves."""
    from e2e.release.registry import IMAGE_PATH, LocalRegistry
    from tests.release.releases import (
        IMAGE_BUILDS,
        clone,
        cosign_key_pair,
        make_snapshot,
        push_signed,
        verify_signed,
    )

    _skip_without_a_real_node()
    if not IMAGE_BUILDS:
        pytest.skip("the release image needs root and gcc")
    snapshot = make_snapshot(clone(tmp_path / "rota"))
    keys = tmp_path / "keys"
    keys.mkdir()
    cosign_key_pair(keys)
    with LocalRegistry(tmp_path / "registry") as registry:
        push_signed(snapshot.clone, registry.target, keys)
        verified = verify_signed(snapshot.clone, registry.target, snapshot.version, keys)
        assert verified.returncode == 0, verified.stderr[-3000:]
        want = f"{registry.address}/{IMAGE_PATH}@" + registry.digest(
            registry.image_ref(snapshot.version))
        subs = Substitutions(node="gpu-node-1", port=_free_port(), registry=registry.target,
                             version=snapshot.version)
        with _own_node(index=201, registry_ports=[registry.port]) as node:
            output = node.run(tmp_path / "docs", _script(_registry_steps(subs)),
                              plain_http=True)
    print("\n" + output)
    sections = _sections(output)
    assert "done" in sections, output[-4000:]
    assert sections["quickstart-requests"].count('"choices"') == 2, sections[
        "quickstart-requests"]
    for name in ("after quickstart-requests", "after chart-readme-install"):
        ids = [line for line in sections[name].splitlines() if "@sha256:" in line]
        assert len(ids) >= 3, f"{name}: {ids}"  # the driver, the controller, the gateway
        assert set(ids) == {want}, f"{name}: {ids}, want {want}"
    again = sections["quickstart-requests-again"]
    assert again.count('"choices"') == 2, again


@dataclass(frozen=True)
class NodeRun:
    """Where the docs' commands run: the cluster's kubeconfig, the node and the tools."""

    kubeconfig: Path
    node: str
    k8s_bin: Path
    tools: Path
    fake_dev_root: str

    def run(self, tmp: Path, script_text: str, *, plain_http: bool = False) -> str:
        """``script_text`` in bash from the repository's root, with kubectl, kubectl-rota
        and helm (adding the fake GPU's values, and ``--plain-http`` for the loopback
        registry when ``plain_http``) on ``PATH``; the transcript."""
        tmp.mkdir(parents=True, exist_ok=True)
        bin_dir = tmp / "bin"
        bin_dir.mkdir()
        (bin_dir / "kubectl").symlink_to(self.k8s_bin / "kubectl")
        (bin_dir / "kubectl-rota").symlink_to(_venv_bin() / "kubectl-rota")
        values = tmp / "fake-gpu-values.yaml"
        proc_dir = "/var/lib/kubelet/plugins/gpu.rota.dev/fake-nvml"
        values.write_text(
            "nvml: {fakeFixture: h200}\n"
            f"cdi: {{devRoot: {self.fake_dev_root}}}\n"
            "driver:\n  extraEnv: [{name: ROTA_FAKE_NVML_PROC_DIR, "
            f"value: {proc_dir}}}]\n"
            "gateway: {replicas: 1}\n")
        helm = bin_dir / "helm"
        helm.write_text(_HELM_WRAPPER.format(
            helm=shlex.quote(str(self.tools / "helm")), values=shlex.quote(str(values)),
            extra=" --plain-http" if plain_http else "",
            why="; the registry has no TLS" if plain_http else ""))
        helm.chmod(0o755)
        script = tmp / "docs.sh"
        script.write_text(script_text)
        env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
               "HOME": str(tmp), "KUBECONFIG": str(self.kubeconfig),
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
