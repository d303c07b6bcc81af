"""rota's container images, built from the repository without a registry or Docker.

:func:`build_images` returns an OCI archive holding the pause image, rota's image and the
engine simulator's image, to be imported with ``ctr -n k8s.io images import``. See
:mod:`e2e.images.build` for the layers and what decides when each is rebuilt.
"""

from e2e.images.build import BuildError, BuiltImages, build_images

ROTA_IMAGE = "ghcr.io/rota-dev/rota:0.1.0"
SIMULATOR_IMAGE = "ghcr.io/rota-dev/rota-engine-simulator:0.1.0"
PAUSE_IMAGE = "rota.local/pause:1"

__all__ = ["PAUSE_IMAGE", "ROTA_IMAGE", "SIMULATOR_IMAGE", "BuildError", "BuiltImages",
           "build_images"]
