# rota's images: driver, lease controller, gateway and engine simulator in one virtualenv
# on Debian's Python. e2e/images builds the same layers without Docker (python -m
# e2e.images): Debian's python3 and libstdc++6 (grpcio needs it), a virtualenv at /opt/rota
# with the dependencies of pyproject.toml, then rota itself.
#
#   docker build --target rota -t ghcr.io/rota-dev/rota:0.1.0 .
#   docker build --target engine-simulator -t ghcr.io/rota-dev/rota-engine-simulator:0.1.0 .
FROM debian:bookworm-slim AS rota
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv libstdc++6 \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/rota
ENV PATH=/opt/rota/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    VIRTUAL_ENV=/opt/rota PYTHONUNBUFFERED=1 LANG=C.UTF-8
WORKDIR /src
COPY pyproject.toml README.md ./
COPY driver ./driver
COPY controller ./controller
COPY rota ./rota
RUN pip install --no-cache-dir . && rm -rf /src
WORKDIR /
USER 0
ENTRYPOINT []

# The engine simulator (behaves like vLLM's sleep-mode API), listening on every address:
# the test harness (e2e/, not in rota's wheel) on top of rota, as e2e/images' harness layer.
FROM rota AS engine-simulator
COPY e2e /opt/rota/lib/python3.11/site-packages/e2e
ENV ROTA_SIM_HOST=0.0.0.0
ENTRYPOINT ["python", "-m", "e2e.engine_simulator"]
