# One image for the API, the worker and the migration job (docker-compose.yml picks the command); the
# migrations ship inside the package (service_core/migrations), so `trainjobs migrate` needs no source.
# torch comes first and pinned, from PyTorch's CUDA wheel index, so `pip install .` never replaces it
# with a different build. Override TORCH_INDEX for another CUDA version (e.g. .../whl/cu126).
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TRAINJOBS_HOME=/data \
    HF_HOME=/data/hf

RUN apt-get update \
    && apt-get install -y --no-install-recommends libsndfile1 curl \
    && rm -rf /var/lib/apt/lists/*

RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY trainer_core ./trainer_core
COPY service_core ./service_core
COPY api ./api
COPY worker ./worker
COPY trainjobs ./trainjobs
RUN pip install ".[all]" && python -c "import torch, trainjobs.cli; print('torch', torch.__version__, torch.version.cuda)" \
    && cd / && rm -rf /app/*

RUN useradd --create-home --uid 1000 trainjobs && mkdir -p /data && chown trainjobs /data
USER trainjobs
VOLUME ["/data"]
EXPOSE 8000
CMD ["trainjobs", "serve", "--host", "0.0.0.0", "--port", "8000"]
