"""The examples in ``manifests/examples``: the real-vLLM ones agree with themselves (budgets,
KV cache, sleep levels, model names, ports, API key, start gate, probes, TP size and device
count), and every example is accepted by the real API server (server-side apply with
``dryRun=All`` and strict field validation) while the chart's admission policies are in
place (the ``cluster`` test)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, dynamic

from e2e.release.chart import Rendered, render
from rota.api.engine_config import EngineConfig, parse_engine_config
from rota.api.quantity import parse_quantity
from tests.chart.minimal import ENGINE_NAMESPACE, MINIMAL
from tests.chart.test_dry_run import _dry_run_apply

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples"
VLLM_EXAMPLES = ("vllm-two-models.yaml", "vllm-tp2-two-models.yaml")
VLLM_IMAGE = "vllm/vllm-openai:v0.26.0"
GPU_BYTES = 80 * 10**9
"""The GPU the examples are sized for (80 GB: H100/A100 80GB)."""
WEIGHT_BYTES = {
    "Qwen/Qwen2.5-7B-Instruct": 15_231_233_024,
    "Qwen/Qwen2.5-Coder-3B-Instruct": 6_171_877_376,
    "Qwen/Qwen2.5-32B-Instruct": 65_527_752_704,
    "Qwen/Qwen2.5-14B-Instruct": 29_540_067_328,
}
"""bf16 weights of the examples' models: about 2 bytes per parameter."""
BESIDE_BYTES = 3 * 2**30
"""The least that vLLM holds beside weights and KV cache (context, activations, graphs)."""


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]


def _claim_spec(doc: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = doc["spec"]["spec"] if doc["kind"] == "ResourceClaimTemplate" \
        else doc["spec"]
    return spec


def _engine_config(doc: dict[str, Any]) -> EngineConfig:
    (config,) = _claim_spec(doc)["devices"]["config"]
    return parse_engine_config(config["opaque"]["parameters"])


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


class Engine:
    """A Deployment of an example with the claim template its pod names."""

    def __init__(self, deployment: dict[str, Any], claims: dict[str, dict[str, Any]]) -> None:
        self.pod = deployment["spec"]["template"]["spec"]
        (self.container,) = self.pod["containers"]
        (ref,) = self.pod["resourceClaims"]
        self.claim = claims[ref["resourceClaimTemplateName"]]
        self.config = _engine_config(self.claim)
        (self.request,) = _claim_spec(self.claim)["devices"]["requests"]
        self.args: list[str] = self.container["args"]

    @property
    def resident(self) -> int:
        return parse_quantity(self.request["exactly"]["capacity"]["requests"]["memory"])

    @property
    def gpus(self) -> int:
        return int(self.request["exactly"].get("count", 1))

    @property
    def tensor_parallel(self) -> int:
        return int(_flag(self.args, "--tensor-parallel-size")) \
            if "--tensor-parallel-size" in self.args else 1


def _engines(name: str) -> list[Engine]:
    docs = _docs(name)
    claims = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ResourceClaimTemplate"}
    return [Engine(d, claims) for d in docs if d["kind"] == "Deployment"]


def test_the_simulator_example_says_it_is_one() -> None:
    text = (EXAMPLES / "two-models.yaml").read_text()
    assert text.startswith("# SIMULATOR EXAMPLE")
    images = {c["image"] for d in _docs("two-models.yaml") if d["kind"] == "Pod"
              for c in d["spec"]["containers"]}
    assert images == {"ghcr.io/rota-dev/rota-engine-simulator:0.1.0"}


@pytest.mark.parametrize("name", VLLM_EXAMPLES)
def test_a_vllm_example_agrees_with_itself(name: str) -> None:
    docs = _docs(name)
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    assert not secrets, f"{name} ships a Secret value"
    engines = _engines(name)
    assert len(engines) == 2
    assert {e.config.sleep_level for e in engines} == {1, 2}  # both levels shown
    for engine in engines:
        c, config = engine.container, engine.config
        assert c["image"] == VLLM_IMAGE
        # rota's start gate in front of vLLM's own server, copied in by an init container
        assert c["command"] == ["/rota/rota-engine-gate", "--", "vllm", "serve"]
        (init,) = engine.pod["initContainers"]
        assert init["command"] == ["rota-engine-gate", "--install", "/rota"]
        assert init["image"].startswith("ghcr.io/rota-dev/rota:")
        assert engine.args[0] == config.model
        assert _flag(engine.args, "--served-model-name") == config.model
        assert int(_flag(engine.args, "--port")) == config.engine_port
        assert "--enable-sleep-mode" in engine.args
        env = {e["name"]: e for e in c["env"]}
        assert env["VLLM_SERVER_DEV_MODE"]["value"] == "1"
        key_ref = env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert config.api_key_secret is not None
        assert (key_ref["name"], key_ref["key"]) == (config.api_key_secret.name,
                                                     config.api_key_secret.key)
        # no key ships (a published one is everyone's): the file says how to make one
        assert key_ref["name"] not in secrets
        header = (EXAMPLES / name).read_text().replace("\\\n#", "")
        assert (f"create secret generic {key_ref['name']}" in " ".join(header.split()))
        assert f'--from-literal={key_ref["key"]}="$(openssl rand -hex 32)"' in header
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": config.engine_port}
        # the start-up probe waits out the gate and the initialisation (10 minutes at least)
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
        # per GPU: this rank's weights + its KV cache + what vLLM holds beside them
        assert engine.tensor_parallel == engine.gpus
        kv_cache = int(_flag(engine.args, "--kv-cache-memory-bytes"))
        weights = WEIGHT_BYTES[config.model] // engine.tensor_parallel
        assert weights + kv_cache + BESIDE_BYTES <= config.awake_memory, config.model
        assert engine.resident < config.awake_memory
        if config.sleep_level == 1:  # the weights sleep in host memory: the limit holds them
            assert parse_quantity(c["resources"]["limits"]["memory"]) > WEIGHT_BYTES[
                config.model]
        if engine.gpus > 1:
            (constraint,) = _claim_spec(engine.claim)["devices"]["constraints"]
            assert constraint["distinctAttribute"] == "gpu.rota.dev/uuid"
            assert engine.request["exactly"]["allocationMode"] == "ExactCount"
            assert any(m["mountPath"] == "/dev/shm" for m in c["volumeMounts"])
    # each awake beside the other asleep fits the GPU, and both ask for the same GPUs
    first, second = engines
    assert first.config.awake_memory + second.resident <= GPU_BYTES
    assert second.config.awake_memory + first.resident <= GPU_BYTES
    assert first.gpus == second.gpus


def test_the_tp_variant_spans_two_gpus() -> None:
    assert {(e.tensor_parallel, e.gpus) for e in _engines("vllm-tp2-two-models.yaml")} == {
        (2, 2)}
    assert {(e.tensor_parallel, e.gpus) for e in _engines("vllm-two-models.yaml")} == {(1, 1)}


# --- on the real API server ----------------------------------------------------------------

@pytest.fixture(scope="module")
def policies_in_place(kube_api: client.ApiClient, chart_bin: Path
                      ) -> Iterator[dynamic.DynamicClient]:
    """The chart's DeviceClass and admission policies with their bindings, created for real
    (those already there are left as they are, and only those created here are deleted)."""
    dyn = dynamic.DynamicClient(kube_api)
    rendered: Rendered = render(set_values=MINIMAL, bin_dir=chart_bin)
    wanted = [d for d in rendered.documents() if d["kind"] in (
        "DeviceClass", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")]
    assert any(d["kind"] == "ValidatingAdmissionPolicyBinding" for d in wanted)
    created: list[tuple[Any, str]] = []
    try:
        for doc in wanted:
            resource = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
            try:
                resource.create(body=doc)
            except client.ApiException as exc:
                if exc.status != 409:
                    raise
            else:
                created.append((resource, doc["metadata"]["name"]))
        try:
            client.CoreV1Api(kube_api).create_namespace({"metadata": {"name": ENGINE_NAMESPACE}})
        except client.ApiException as exc:
            if exc.status != 409:
                raise
        yield dyn
    finally:
        for resource, name in reversed(created):
            resource.delete(name=name)


def _in_namespace(doc: dict[str, Any]) -> dict[str, Any]:
    return {**doc, "metadata": {**doc["metadata"], "namespace": ENGINE_NAMESPACE}}


@pytest.mark.cluster
@pytest.mark.parametrize("name", ["two-models.yaml", *VLLM_EXAMPLES])
def test_an_example_is_accepted_by_the_api_server(policies_in_place: dynamic.DynamicClient,
                                                  name: str) -> None:
    docs = _docs(name)
    refused = [problem for doc in docs
               if (problem := _dry_run_apply(policies_in_place, _in_namespace(doc)))]
    assert not refused


@pytest.mark.cluster
def test_the_api_server_refuses_a_broken_example(policies_in_place: dynamic.DynamicClient
                                                 ) -> None:
    template = next(d for d in _docs("vllm-tp2-two-models.yaml")
                    if d["kind"] == "ResourceClaimTemplate")
    template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["allocationMode"] = "Two"
    assert "allocationMode" in _dry_run_apply(policies_in_place, _in_namespace(template))
