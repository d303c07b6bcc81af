"""Engines' refusals are told apart by what their answer says: GPU memory, host memory,
credentials, anything else."""

from __future__ import annotations

import json

import pytest

from controller.engines.errors import EngineRejected


def _vllm(message: str) -> str:
    return json.dumps({"error": {"message": message, "type": "InternalServerError",
                                 "param": None, "code": 500}})


@pytest.mark.parametrize(("status", "body", "reason"), [
    (500, _vllm("Call to wake_up method failed: CUDA Error: out of memory at alloc.cpp:75"),
     "gpu_oom"),
    (500, _vllm("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB"),
     "gpu_oom"),
    (500, _vllm("Call to sleep method failed: DefaultCPUAllocator: can't allocate memory"),
     "host_oom"),
    (500, _vllm("RuntimeError: cannot allocate pinned memory for the weights"), "host_oom"),
    (401, '{"error": "Unauthorized"}', "unauthorized"),
    (500, _vllm("something else went wrong"), "rejected"),
    (502, "<html>bad gateway</html>", "rejected"),
])
def test_refusals_get_distinct_reasons(status: int, body: str, reason: str) -> None:
    assert EngineRejected("wake failed", step="wake", status=status, body=body).reason == reason
