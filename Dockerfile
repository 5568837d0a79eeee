# One image for every trainguard service: `python -m trainguard.agents|detector|attributor|remediator|
# checkpoint_validator`, `python -m trainguard.rendezvous.store`, `trainguard ...`.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
# the services' small objects from the C heap, whose freed pages they return to the OS
# (trainguard.services.memory.release_freed_memory; docs/benchmarks.md, "Hostile input": the fuzz bench's RSS)
ENV PYTHONMALLOC=malloc

# The CPU build of torch is installed first so that pip does not pull a CUDA build; for GPU
# nodes build with e.g. --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX}" "${TORCH_SPEC}"

WORKDIR /opt/trainguard
COPY . .
RUN pip install ".[services,kubernetes]" && useradd --system --uid 10001 --no-create-home trainguard

USER 10001
# Each container chooses its service with `command:`; this default prints the CLI help.
CMD ["trainguard", "--help"]
