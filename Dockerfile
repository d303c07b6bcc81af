# One image for the driver, the lease controller and the gateway.
FROM python:3.12-slim
WORKDIR /src
COPY pyproject.toml README.md ./
COPY driver ./driver
COPY controller ./controller
COPY proto ./proto
COPY e2e ./e2e
RUN pip install --no-cache-dir . && rm -rf /src
USER 0
ENTRYPOINT []
