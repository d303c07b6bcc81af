"""rota's DRA kubelet plugin: publishes GPUs as shared devices and prepares claims for them."""

DRIVER_NAME = "gpu.rota.dev"
