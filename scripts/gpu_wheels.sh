#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (its python3 3.12 has torch, transformers, tokenizers, safetensors, httpx,
# h11, anyio, click, jinja2, prometheus-client, pytest), fetched here into .whl/ (git-ignored) for
# scripts/gpu_check.sh to install offline there. Versions are this project's pins (requirements.txt) or, for the
# ones it does not pin, what that pin resolved to here.
#
#   bash scripts/gpu_wheels.sh          # then name .whl in the device run's carry
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7
    opentelemetry-api==1.45.2
    llguidance==1.9.1 gguf==0.19.0
)
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "${WHEELS[@]}"
ls -l .whl
du -sh .whl
