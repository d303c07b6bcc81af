"""OCI image archives: what ``ctr images import`` reads, written without a registry.

An archive is a tar in OCI image layout: ``oci-layout``, ``index.json`` (one manifest per
image, named by the ``io.containerd.image.name`` annotation) and ``blobs/sha256/*`` (the
configs, the manifests and the layer tars, each once even when images share layers).
Layers are uncompressed tars, so a layer's digest is also its diff id.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from e2e.images.layer import LayerInfo

LAYER_MEDIA_TYPE = "application/vnd.oci.image.layer.v1.tar"
CONFIG_MEDIA_TYPE = "application/vnd.oci.image.config.v1+json"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"


class ImageSpec(BaseModel):
    """One image of an archive: its name, its layers (bottom first) and its process."""

    name: str
    layers: list[LayerInfo]
    entrypoint: list[str] = Field(default_factory=list)
    cmd: list[str] = Field(default_factory=list)
    env: list[str] = Field(default_factory=list)
    working_dir: str = "/"
    labels: dict[str, str] = Field(default_factory=dict)

    def config(self) -> dict[str, Any]:
        process: dict[str, Any] = {"Env": self.env, "WorkingDir": self.working_dir}
        if self.entrypoint:
            process["Entrypoint"] = self.entrypoint
        if self.cmd:
            process["Cmd"] = self.cmd
        if self.labels:
            process["Labels"] = self.labels
        return {
            "architecture": "amd64", "os": "linux", "config": process,
            "rootfs": {"type": "layers", "diff_ids": [layer.digest for layer in self.layers]},
        }


def _blob(data: bytes) -> tuple[str, bytes]:
    return f"sha256:{hashlib.sha256(data).hexdigest()}", data


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    tar.addfile(info, io.BytesIO(data))


def _json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _manifest(image: ImageSpec) -> tuple[tuple[str, bytes], tuple[str, bytes]]:
    """The image's config and manifest blobs (digest, bytes)."""
    config_digest, config = _blob(_json(image.config()))
    manifest = {
        "schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE,
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": config_digest,
                   "size": len(config)},
        "layers": [{"mediaType": LAYER_MEDIA_TYPE, "digest": layer.digest,
                    "size": layer.size} for layer in image.layers],
    }
    return (config_digest, config), _blob(_json(manifest))


def manifest_digest(image: ImageSpec) -> str:
    """The digest of the image's manifest as :func:`write_archive` writes it: what a
    registry serves it under and what ``name@sha256:...`` pins."""
    return _manifest(image)[1][0]


def write_archive(dest: Path, images: Sequence[ImageSpec]) -> Path:
    """Write every image into one OCI archive at ``dest`` (temp file, then renamed)."""
    temp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    dest.parent.mkdir(parents=True, exist_ok=True)
    written: set[str] = set()
    manifests: list[dict[str, Any]] = []
    with tarfile.open(temp, "w", format=tarfile.PAX_FORMAT) as tar:
        _add_bytes(tar, "oci-layout", _json({"imageLayoutVersion": "1.0.0"}))
        for image in images:
            (config_digest, config), (digest_of_manifest, manifest_bytes) = _manifest(image)
            for digest, data in ((config_digest, config),
                                 (digest_of_manifest, manifest_bytes)):
                if digest not in written:
                    _add_bytes(tar, f"blobs/sha256/{digest.split(':')[1]}", data)
                    written.add(digest)
            for layer in image.layers:
                if layer.digest not in written:
                    tar.add(str(layer.path), arcname=f"blobs/sha256/{layer.digest.split(':')[1]}")
                    written.add(layer.digest)
            tag = image.name.rsplit(":", 1)[1] if ":" in image.name.rsplit("/", 1)[-1] \
                else "latest"
            manifests.append({
                "mediaType": MANIFEST_MEDIA_TYPE, "digest": digest_of_manifest,
                "size": len(manifest_bytes),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {"io.containerd.image.name": image.name,
                                "org.opencontainers.image.ref.name": tag},
            })
        _add_bytes(tar, "index.json", _json({"schemaVersion": 2, "mediaType": INDEX_MEDIA_TYPE,
                                             "manifests": manifests}))
    os.replace(temp, dest)
    return dest
