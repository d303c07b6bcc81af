"""The chart lints, renders with every value set, and renders what the design asks for:
least privilege per pod, probes that outlast their handlers, a gateway grace period that
fits the longest request, a generated activation token that is never a placeholder."""

from __future__ import annotations

import base64
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.credentials import PLACEHOLDERS
from driver.settings import DriverSettings
from e2e.release.chart import CHART, KUBE_VERSION, Rendered, render, run_tool
from tests.chart.minimal import ENGINE_NAMESPACE, MINIMAL

VALUE_SETS = sorted((CHART / "ci").glob("*-values.yaml"))


def _pod(rendered: Rendered, kind: str, name: str) -> dict[str, Any]:
    [obj] = rendered.find(kind, name)
    spec: dict[str, Any] = obj["spec"]["template"]["spec"]
    return spec


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


@pytest.fixture(scope="module")
def default(chart_bin: Path) -> Rendered:
    """Every value at its default but the one an install must set (engineNamespaces)."""
    return render(set_values=MINIMAL, bin_dir=chart_bin)


@pytest.fixture(scope="module")
def hardened(chart_bin: Path) -> Rendered:
    return render(values_files=[CHART / "ci" / "hardened-values.yaml"], release="prod",
                  bin_dir=chart_bin)


def test_there_are_two_non_default_value_sets() -> None:
    names = {p.name for p in VALUE_SETS}
    assert {"hardened-values.yaml", "monitoring-values.yaml"} <= names


@pytest.mark.parametrize("values", [None, *VALUE_SETS], ids=lambda p: p.name if p else "default")
def test_helm_lint(chart_bin: Path, values: Path | None) -> None:
    args = ["lint", str(CHART), "--strict", "--kube-version", KUBE_VERSION]
    if values is not None:
        args += ["--values", str(values)]
    else:
        args += [f"--set={k}={v}" for k, v in MINIMAL.items()]
    done = run_tool("helm", args, bin_dir=chart_bin)
    assert "0 chart(s) failed" in done.stdout


def test_the_schema_refuses_unknown_and_wrong_values(chart_bin: Path) -> None:
    for bad in ("sharing.mode=everything", "nvml.source=guess", "ipFamily=IPv5",
                "driver.colour=blue", "nodeSelection.mode=nvidia"):
        done = run_tool("helm", ["template", "x", str(CHART), "--kube-version", KUBE_VERSION,
                                 "--set", bad, *(f"--set={k}={v}" for k, v in MINIMAL.items())],
                        bin_dir=chart_bin, check=False)
        assert done.returncode != 0, bad
        assert "schema" in done.stderr, (bad, done.stderr)


def test_components_are_labelled_by_name_instance_and_component(default: Rendered) -> None:
    for obj in default.documents():
        labels = obj["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/name") == "rota", obj["metadata"]
        assert labels.get("app.kubernetes.io/managed-by") == "Helm"
        assert "helm.sh/chart" in labels
    for kind, name, component in (("DaemonSet", "rota-driver", "driver"),
                                  ("DaemonSet", "rota-controller", "controller"),
                                  ("Deployment", "rota-gateway", "gateway")):
        [obj] = default.find(kind, name)
        selector = obj["spec"]["selector"]["matchLabels"]
        assert selector == {"app.kubernetes.io/name": "rota",
                            "app.kubernetes.io/instance": "rota",
                            "app.kubernetes.io/component": component}
        pod_labels = obj["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= pod_labels.items()
        # No chart version on pods: a chart upgrade that changes nothing else rolls nothing.
        assert "helm.sh/chart" not in pod_labels


def test_only_the_driver_pod_shares_the_host_pid_namespace(default: Rendered) -> None:
    pods = [_pod(default, kind, name) for kind, name in (
        ("DaemonSet", "rota-driver"), ("DaemonSet", "rota-controller"),
        ("Deployment", "rota-gateway"))]
    assert [bool(p.get("hostPID")) for p in pods] == [True, False, False]


def test_the_controller_mounts_only_the_inspection_socket_directory(default: Rendered) -> None:
    driver = _pod(default, "DaemonSet", "rota-driver")
    controller = _pod(default, "DaemonSet", "rota-controller")
    host_paths = {v["name"]: v["hostPath"]["path"] for v in controller["volumes"]
                  if "hostPath" in v}
    assert sorted(host_paths) == ["inspect", "start-gate"]
    [container] = controller["containers"]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "inspect"]
    assert mount["readOnly"] is True
    # The driver, as configured by the chart, puts its inspection socket there and nothing
    # else: not the ledger, not the DRA socket, not the registration socket.
    env = _env(driver["containers"][0])
    settings = DriverSettings(node_name="n", pod_uid="0b7f6c8e-1d2a-4e3b-9c4d-5e6f7a8b9c0d",
                              plugin_data_dir=Path(env["ROTA_PLUGIN_DATA_DIR"]),
                              plugin_registry_dir=Path(env["ROTA_PLUGIN_REGISTRY_DIR"]),
                              inspect_dir=Path(env["ROTA_INSPECT_DIR"]))
    shared = Path(host_paths["inspect"])
    assert settings.inspect_socket.parent == shared
    assert settings.inspect_listen_socket.parent == shared
    assert Path(_env(container)["ROTA_INSPECT_SOCKET"]) == settings.inspect_socket
    for private in (settings.ledger_path, settings.dra_socket, settings.registration_socket,
                    settings.lock_path):
        assert shared not in private.parents, private


def test_controller_and_gateway_run_unprivileged(default: Rendered) -> None:
    for kind, name in (("DaemonSet", "rota-controller"), ("Deployment", "rota-gateway")):
        pod = _pod(default, kind, name)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        [container] = pod["containers"]
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
    driver = _pod(default, "DaemonSet", "rota-driver")
    assert driver["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert driver["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True


def test_probe_timeouts_exceed_what_their_handlers_may_take(default: Rendered) -> None:
    from driver import probes

    driver = _pod(default, "DaemonSet", "rota-driver")["containers"][0]
    # /healthz makes two gRPC calls of at most _PROBE_TIMEOUT_S each.
    worst = 2 * probes._PROBE_TIMEOUT_S
    for probe in ("startupProbe", "livenessProbe"):
        assert driver[probe]["httpGet"]["path"] == "/healthz"
        assert driver[probe]["timeoutSeconds"] > worst, probe
    for kind, name in (("DaemonSet", "rota-controller"), ("Deployment", "rota-gateway")):
        [container] = _pod(default, kind, name)["containers"]
        for probe in ("livenessProbe", "readinessProbe"):
            assert container[probe]["timeoutSeconds"] >= 5, (name, probe)


def test_the_gateway_grace_period_fits_the_longest_request(default: Rendered,
                                                           hardened: Rendered) -> None:
    for rendered, longest in ((default, 600), (hardened, 1800)):
        pod = next(_pod(rendered, "Deployment", name) for name in
                   ("rota-gateway", "prod-rota-gateway") if rendered.find("Deployment", name))
        [container] = pod["containers"]
        pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert pre_stop > 0
        assert pod["terminationGracePeriodSeconds"] >= pre_stop + longest


def test_the_activation_token_is_random_and_never_a_placeholder(chart_bin: Path) -> None:
    tokens = []
    for _ in range(2):
        [secret] = render(set_values=MINIMAL, bin_dir=chart_bin).find(
            "Secret", "rota-activation-token")
        token = base64.b64decode(secret["data"]["token"]).decode()
        assert token not in PLACEHOLDERS
        assert len(token) == 48
        assert token.isalnum()
        tokens.append(token)
    assert tokens[0] != tokens[1]


def test_an_existing_activation_secret_is_used_not_generated(hardened: Rendered,
                                                             chart_bin: Path) -> None:
    rendered = render(set_values={**MINIMAL, "activation.existingSecret": "mine"},
                      bin_dir=chart_bin)
    assert rendered.find("Secret") == []
    for kind, name in (("DaemonSet", "rota-controller"), ("Deployment", "rota-gateway")):
        pod = _pod(rendered, kind, name)
        [volume] = [v for v in pod["volumes"] if v["name"] == "activation-token"]
        assert volume["secret"]["secretName"] == "mine"


def test_nvml_from_a_host_path_or_the_runtime_class(default: Rendered,
                                                    hardened: Rendered) -> None:
    driver = _pod(default, "DaemonSet", "rota-driver")
    [volume] = [v for v in driver["volumes"] if v["name"] == "nvml"]
    assert volume["hostPath"] == {"path": "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
                                  "type": "File"}
    [container] = driver["containers"]
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "nvml"]
    assert Path(mount["mountPath"]).parent == Path(_env(container)["LD_LIBRARY_PATH"])
    assert "runtimeClassName" not in driver

    runtime = _pod(hardened, "DaemonSet", "prod-rota-driver")
    assert runtime["runtimeClassName"] == "nvidia"
    assert not [v for v in runtime["volumes"] if v["name"] == "nvml"]
    assert _env(runtime["containers"][0])["NVIDIA_VISIBLE_DEVICES"] == "all"


@pytest.mark.parametrize("dev_root", [None, "/run/nvidia/driver/dev"])
def test_the_driver_looks_for_device_nodes_in_a_live_mount_of_the_host_device_root(
        chart_bin: Path, dev_root: str | None) -> None:
    """Not in its own /dev, a copy made when the container started."""
    rendered = render(set_values={**MINIMAL, **({"cdi.devRoot": dev_root} if dev_root else {})},
                      bin_dir=chart_bin)
    driver = _pod(rendered, "DaemonSet", "rota-driver")
    [container] = driver["containers"]
    env = _env(container)
    settings = DriverSettings(node_name="n", dev_root=Path(env["ROTA_DEV_ROOT"]),
                              dev_root_mount=Path(env["ROTA_DEV_ROOT_MOUNT"]))
    assert settings.dev_root == Path(dev_root or "/dev")
    [volume] = [v for v in driver["volumes"] if v["name"] == "host-dev"]
    assert volume["hostPath"] == {"path": str(settings.dev_root), "type": "Directory"}
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "host-dev"]
    assert Path(mount["mountPath"]) == settings.dev_root_mount
    assert mount["readOnly"] is True
    # /dev is one devtmpfs, live as mounted; a driver root may be mounted on it later.
    assert mount.get("mountPropagation") == ("HostToContainer" if dev_root else None)


def test_node_selection_needs_no_feature_discovery(default: Rendered,
                                                   hardened: Rendered) -> None:
    for name in ("rota-driver", "rota-controller"):
        terms = _pod(default, "DaemonSet", name)["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms == [{"matchExpressions": [{"key": "gpu.rota.dev/enabled",
                                                "operator": "In", "values": ["true"]}]}]
    nfd = _pod(hardened, "DaemonSet", "prod-rota-driver")
    terms = nfd["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["key"] == "feature.node.kubernetes.io/pci-10de.present"
    assert nfd["nodeSelector"] == {"node-pool": "gpu"}


def _listeners(rendered: Rendered, prefix: str) -> dict[str, str]:
    envs = {name: _env(_pod(rendered, kind, f"{prefix}{name}")["containers"][0])
            for kind, name in (("DaemonSet", "driver"), ("DaemonSet", "controller"),
                               ("Deployment", "gateway"))}
    return {"driver": envs["driver"]["ROTA_HTTP_ADDRESS"],
            "controller": envs["controller"]["ROTA_LISTEN"],
            "gateway": envs["gateway"]["ROTA_GATEWAY_HOST"]}


def test_every_listener_is_dual_stack_and_the_controller_advertises_its_pod_ip(
        default: Rendered, hardened: Rendered, chart_bin: Path) -> None:
    """IPv4, IPv6 and dual-stack clusters alike, with no setting (review-2 minor 12: the
    listeners bound 0.0.0.0 unless ipFamily said IPv6)."""
    for rendered, prefix in ((default, "rota-"), (hardened, "prod-rota-"),
                             (render(set_values={**MINIMAL, "ipFamily": "IPv6"},
                                     bin_dir=chart_bin), "rota-")):
        assert _listeners(rendered, prefix) == {"driver": "[::]:8081",
                                                "controller": "[::]:8090", "gateway": "::"}
        [container] = _pod(rendered, "DaemonSet", f"{prefix}controller")["containers"]
        env = {e["name"]: e for e in container["env"]}
        # The pod IP as the kubelet gives it; the controller brackets an IPv6 one.
        assert env["ROTA_ADVERTISE_HOST"]["valueFrom"] == {
            "fieldRef": {"fieldPath": "status.podIP"}}
        assert "ROTA_ADVERTISE_URL" not in env


def test_engine_namespaces_get_network_policies_and_namespaced_pod_reads(
        default: Rendered, hardened: Rendered) -> None:
    assert [p["metadata"]["namespace"] for p in default.find("NetworkPolicy", "rota-engines")] \
        == [ENGINE_NAMESPACE]
    policies = hardened.find("NetworkPolicy", "prod-rota-engines")
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["team-a", "team-b"]
    # Claims and pods only there: no ClusterRole (tests/chart/test_least_privilege.py).
    assert hardened.find("ClusterRole", "prod-rota-gateway") == []
    roles = hardened.find("Role", "prod-rota-gateway-pods")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]


# -- the engines' control endpoints (review-2 M5) -----------------------------------------


def _template(chart_bin: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    args = ["template", "rota", str(CHART), "--namespace", "rota-system",
            "--kube-version", KUBE_VERSION]
    for item in sets:
        args += ["--set", item]
    return run_tool("helm", args, bin_dir=chart_bin, check=False)


def test_an_install_without_engine_namespaces_is_refused_unless_left_open_explicitly(
        chart_bin: Path) -> None:
    refused = _template(chart_bin)
    assert refused.returncode != 0
    assert "engineNamespaces is empty" in refused.stderr, refused.stderr
    assert "networkPolicy.enginesOpen=true" in refused.stderr, refused.stderr

    left_open = _template(chart_bin, "networkPolicy.enginesOpen=true")
    assert left_open.returncode == 0, left_open.stderr
    assert Rendered(left_open.stdout).find("NetworkPolicy", "rota-engines") == []
    # Turning every NetworkPolicy off is an explicit choice too.
    assert _template(chart_bin, "networkPolicy.enabled=false").returncode == 0


def test_the_engine_policy_covers_every_pod_of_an_engine_namespace(
        default: Rendered, chart_bin: Path) -> None:
    [policy] = default.find("NetworkPolicy", "rota-engines")
    spec = policy["spec"]
    # Every pod but those labelled out: an engine pod without the label is covered too.
    assert spec["podSelector"] == {"matchExpressions": [
        {"key": "gpu.rota.dev/engine", "operator": "NotIn", "values": ["false"]}]}
    assert spec["policyTypes"] == ["Ingress"]
    [rule] = spec["ingress"]
    assert "ports" not in rule
    [peer] = rule["from"]
    assert peer["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "rota-system"}}
    assert {e["key"]: e["values"] for e in peer["podSelector"]["matchExpressions"]} == {
        "app.kubernetes.io/name": ["rota"], "app.kubernetes.io/instance": ["rota"],
        "app.kubernetes.io/component": ["controller", "gateway"]}

    labelled = render(set_values={**MINIMAL, "networkPolicy.enginePods": "labelled"},
                      bin_dir=chart_bin)
    [policy] = labelled.find("NetworkPolicy", "rota-engines")
    assert policy["spec"]["podSelector"] == {"matchLabels": {"gpu.rota.dev/engine": "true"}}


# -- the gateway's Secret reads (review-2 minor 9) ----------------------------------------


def _secret_rules(rendered: Rendered, gateway: str) -> dict[str, list[dict[str, Any]]]:
    """Namespace ("" for the ClusterRole) -> the gateway's rules on Secrets there."""
    out: dict[str, list[dict[str, Any]]] = {}
    for kind in ("ClusterRole", "Role"):
        for role in rendered.find(kind):
            if not role["metadata"]["name"].startswith(gateway):
                continue
            rules = [r for r in role["rules"] if "secrets" in r["resources"]]
            if rules:
                out.setdefault(role["metadata"].get("namespace", ""), []).extend(rules)
    return out


def test_the_gateway_reads_only_the_named_engine_key_secrets(hardened: Rendered,
                                                             default: Rendered,
                                                             chart_bin: Path) -> None:
    # hardened-values names one Secret: readable by that name in each engine namespace.
    want = [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["engine-api-key"],
             "verbs": ["get"]}]
    assert _secret_rules(hardened, "prod-rota-gateway") == {"team-a": want, "team-b": want}
    # None named: no Secret is readable, in no namespace (NOTES says what that means).
    assert _secret_rules(default, "rota-gateway") == {}
    # Engines in any namespace (explicitly open): the named Secrets in every namespace.
    everywhere = render(set_values={"networkPolicy.enginesOpen": "true",
                                    "gateway.engineApiKeySecrets": "{llama-key,omni-key}"},
                        bin_dir=chart_bin)
    assert _secret_rules(everywhere, "rota-gateway") == {"": [
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["llama-key", "omni-key"],
         "verbs": ["get"]}]}


def test_the_start_gate_socket_is_where_the_driver_mounts_it_into_engines(
        default: Rendered, chart_bin: Path) -> None:
    """The controller listens in the host directory that the driver's CDI specs mount into
    engine containers; both pods mount it (the controller's root filesystem is read-only:
    without it the controller could not start). Off, both are told so by flags."""
    driver = _pod(default, "DaemonSet", "rota-driver")
    controller = _pod(default, "DaemonSet", "rota-controller")
    gate_dir = _env(driver["containers"][0])["ROTA_START_GATE_DIR"]
    assert Path(_env(controller["containers"][0])["ROTA_START_SOCKET"]).parent == Path(gate_dir)
    for pod in (driver, controller):
        [volume] = [v for v in pod["volumes"] if v["name"] == "start-gate"]
        assert volume["hostPath"] == {"path": gate_dir, "type": "DirectoryOrCreate"}
        [mount] = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "start-gate"]
        assert mount["mountPath"] == gate_dir
    env = _env(driver["containers"][0])
    settings = DriverSettings(node_name="n", pod_uid="0b7f6c8e-1d2a-4e3b-9c4d-5e6f7a8b9c0d",
                              plugin_data_dir=Path(env["ROTA_PLUGIN_DATA_DIR"]))
    assert Path(gate_dir) not in settings.start_gate_key_path.parents  # the key stays private
    off = render(set_values=MINIMAL | {"startGate.enabled": "false"}, bin_dir=chart_bin)
    assert _pod(off, "DaemonSet", "rota-controller")["containers"][0]["args"] == [
        "--start-socket="]
    assert _pod(off, "DaemonSet", "rota-driver")["containers"][0]["args"] == [
        "--start-gate-dir="]


# -- the model binding and engineNamespaces (review 2026-12 R4) -----------------------------


def test_a_binding_wider_than_the_engine_namespaces_is_refused(chart_bin: Path) -> None:
    """The gateway may list pods only in engineNamespaces: a binding that names anything
    else (a pattern too) could never be served there, and is refused at render time."""
    engines = f"engineNamespaces={{{ENGINE_NAMESPACE},team-a}}"
    for wider, outside in (("gateway.modelBinding.namespaces={*}", "*"),
                           ("gateway.modelBinding.namespaces={team-*}", "team-*"),
                           ("gateway.modelBinding.namespaces={team-[ab]}", "team-[ab]"),
                           ("gateway.modelBinding.models.org/x={team-a,prod}", "prod")):
        refused = _template(chart_bin, engines, wider)
        assert refused.returncode != 0, wider
        assert "gateway.modelBinding names namespaces outside engineNamespaces" \
            in refused.stderr, refused.stderr
        assert f": {outside}." in refused.stderr, refused.stderr
    # The engine namespaces by name render, for any model.
    fits = _template(chart_bin, engines, f"gateway.modelBinding.namespaces={{{ENGINE_NAMESPACE}}}",
                     "gateway.modelBinding.models.org/x={team-a}")
    assert fits.returncode == 0, fits.stderr
    # With engineNamespaces empty (engines left open) the gateway reads every namespace's
    # pods, and every pattern is fine.
    open_ = _template(chart_bin, "networkPolicy.enginesOpen=true",
                      "gateway.modelBinding.namespaces={*}")
    assert open_.returncode == 0, open_.stderr


# -- shutdown as documented (review 2026-12) ------------------------------------------------

UPGRADE_DOC = CHART.parent.parent / "docs" / "upgrade.md"


def _section(doc: str, heading: str) -> str:
    start = doc.index(heading)
    end = doc.find("\n## ", start + len(heading))
    return doc[start:] if end < 0 else doc[start:end]


def _controller_settings(pod: dict[str, Any]) -> Any:
    """The lease controller's settings as its container's literal env and args give them."""
    from controller.lease.settings import load

    [container] = pod["containers"]
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    return load(container.get("args", []), env | {"NODE_NAME": "n", "POD_NAMESPACE": "ns"})


def test_the_controller_lets_the_switch_in_flight_finish_within_its_grace_period(
        default: Rendered, hardened: Rendered, chart_bin: Path) -> None:
    from controller.lease.settings import StepTimeouts

    longer = render(set_values=MINIMAL | {"controller.terminationGracePeriodSeconds": "900"},
                    bin_dir=chart_bin)
    for rendered, name, period in ((default, "rota-controller", 420),
                                   (hardened, "prod-rota-controller", 420),
                                   (longer, "rota-controller", 900)):
        pod = _pod(rendered, "DaemonSet", name)
        assert pod["terminationGracePeriodSeconds"] == period
        grace = _controller_settings(pod).shutdown_grace_s
        # Below the grace period (the Lease is released before the kill) ...
        assert grace < period, (name, grace)
        assert grace == period - 20, (name, grace)
        # ... and long enough for the longest wake, not the binary's own 25 s.
        assert grace > StepTimeouts().wake_s, (name, grace)


def test_the_upgrade_guide_states_the_grace_periods_the_chart_and_code_use(
        default: Rendered) -> None:
    from controller.gateway.settings import GatewaySettings
    from controller.lease.settings import LeaseSettings

    doc = UPGRADE_DOC.read_text()
    controller_pod = _pod(default, "DaemonSet", "rota-controller")
    controller_grace = _controller_settings(controller_pod).shutdown_grace_s
    section = _section(doc, "## The lease controller DaemonSet")
    stated = re.search(r"(\d+) s with the default grace period of (\d+) s", section)
    assert stated is not None, section
    assert (int(stated[1]), int(stated[2])) == (
        controller_grace, controller_pod["terminationGracePeriodSeconds"])
    own = re.search(r"The flag's own default, for a controller run without the chart, "
                    r"is (\d+) s", section)
    assert own is not None, section
    assert float(own[1]) == LeaseSettings.model_fields["shutdown_grace_s"].default

    [gateway] = _pod(default, "Deployment", "rota-gateway")["containers"]
    rendered_grace = float(_env(gateway)["ROTA_GATEWAY_SHUTDOWN_GRACE_S"])
    section = _section(doc, "## The gateway Deployment")
    stated = re.search(r"`--shutdown-grace-s`, (\d+) s by default", section)
    assert stated is not None, section
    assert float(stated[1]) == rendered_grace \
        == GatewaySettings.model_fields["shutdown_grace_s"].default
    delay = re.search(r"`--shutdown-delay-s`, (\d+) s", section)
    assert delay is not None
    assert float(delay[1]) == float(_env(gateway)["ROTA_GATEWAY_SHUTDOWN_DELAY_S"])
    assert "30 s" not in section


# -- the controller's writes of claims and pods (review 2026-12 R9) -------------------------


def test_the_controllers_claim_status_writes_are_kept_to_its_node_on_every_version(
        default: Rendered, hardened: Rendered) -> None:
    for rendered, controller in ((default, "rota-controller"),
                                 (hardened, "prod-rota-controller")):
        [policy] = rendered.find("ValidatingAdmissionPolicy", f"{controller}-claims")
        spec = policy["spec"]
        assert spec["failurePolicy"] == "Fail"
        [rule] = spec["matchConstraints"]["resourceRules"]
        assert rule["resources"] == ["resourceclaims/status"]
        assert rule["operations"] == ["UPDATE"]
        [condition] = spec["matchConditions"]
        namespace = "rota-system"
        assert f'"system:serviceaccount:{namespace}:{controller}"' in condition["expression"]
        checks = " ".join(v["expression"] for v in spec["validations"])
        for kept in ("allocation", "reservedFor", "othersNew == variables.othersOld",
                     "allocatedHere"):
            assert kept in checks, kept
        [binding] = rendered.find("ValidatingAdmissionPolicyBinding", f"{controller}-claims")
        assert binding["spec"] == {"policyName": f"{controller}-claims",
                                   "validationActions": ["Deny"]}
        # The state label: engine pods only (pods that use a claim), to rota's states.
        [pods] = rendered.find("ValidatingAdmissionPolicy", f"{controller}-pods")
        checks = " ".join(v["expression"] for v in pods["spec"]["validations"])
        assert "spec.?resourceClaims" in checks
        from controller.lease.visible_state import EngineState

        states = re.search(r"in \[([^\]]*)\]", checks)
        assert states is not None, checks
        assert {s.strip(" '") for s in states[1].split(",")} == {s.value for s in EngineState}


# -- the switch policy and the gateway's places as chart values ----------------------------

def test_the_switch_policy_and_the_gateways_places_are_chart_values(
        default: Rendered, chart_bin: Path, tmp_path: Path) -> None:
    from controller.gateway.settings import load as gateway_settings
    from controller.lease.settings import LeaseSettings
    from controller.lease.tenants import TenantLimits

    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"controller": {"policy": {
        "mode": "first-come", "quantumFactor": 2.5, "minQuantumSeconds": 3, "maxWaitSeconds": 12,
        "keepAliveSeconds": 90, "priority": 5, "shareWeight": 2,
        "priorityCeilings": {"prod": 100, "team-*": {"priority": 10, "maxWaitSeconds": 60,
                                                     "home": True}}, "homeModel": "org/chat",
        "homeIdleSeconds": 30}},
        "gateway": {"maxConcurrencyPerEngine": 16, "queueSize": 32}}))
    set_ = render(set_values=MINIMAL, values_files=[values], bin_dir=chart_bin)
    s = _controller_settings(_pod(set_, "DaemonSet", "rota-controller"))
    assert (s.policy_quantum_factor, s.policy_min_quantum_s, s.policy_max_wait_s,
            s.policy_keep_alive_s, s.policy_priority, s.policy_share_weight) == (
        2.5, 3, 12, 90, 5, 2)
    assert s.policy_priority_ceilings.root == {"prod": 100, "team-*": TenantLimits(
        priority=10, max_wait_seconds=60, home=True)}
    assert list(s.policy_priority_ceilings.root) == ["prod", "team-*"]
    assert (s.home_model, s.home_idle_s) == ("org/chat", 30)
    assert s.policy_mode == "first-come"
    [gateway] = _pod(set_, "Deployment", "rota-gateway")["containers"]
    env = {e["name"]: e["value"] for e in gateway["env"] if "value" in e}
    g = gateway_settings(gateway.get("args", []), env)
    assert (g.max_concurrency_per_engine, g.queue_size) == (16, 32)
    # The defaults render to the binaries' own defaults.
    d = _controller_settings(_pod(default, "DaemonSet", "rota-controller"))
    for name in ("policy_mode", "policy_quantum_factor", "policy_min_quantum_s",
                 "policy_max_wait_s", "policy_keep_alive_s", "policy_priority",
                 "policy_share_weight", "home_model", "home_idle_s"):
        assert getattr(d, name) == LeaseSettings.model_fields[name].default, name
    assert d.policy_priority_ceilings.root == {}


def test_the_gateway_allows_the_freeze_the_controllers_allow(chart_bin: Path) -> None:
    """A claim that names no longestFreezeSeconds is frozen by the controllers up to the
    chart's ``controller.policy.longestFreezeSeconds``; the gateway's read timeout and
    the progress it reports of a frozen stream must allow the same freeze, so the chart
    gives both the one value (the gateway used its own 3 s default)."""
    rendered = render(set_values={**MINIMAL, "controller.policy.longestFreezeSeconds": "7"},
                      bin_dir=chart_bin)
    [controller] = _pod(rendered, "DaemonSet", "rota-controller")["containers"]
    [gateway] = _pod(rendered, "Deployment", "rota-gateway")["containers"]
    assert _env(controller)["ROTA_LONGEST_FREEZE_S"] == "7"
    assert _env(gateway)["ROTA_GATEWAY_LONGEST_FREEZE_S"] == "7"
