#!/usr/bin/env bash
# Regenerate docs/passkey_smollm2.png, docs/niah_smollm2.png and docs/eval_results_smollm2.json:
# `kvtier eval` on the embedded SmolLM2-135M-Instruct (8K trained context) with lossless
# inference (method auto), fp32 on the CPU. About 20 minutes on 2 idle CPU cores (an 8K-token
# prefill takes about a minute there); the committed run took 57 minutes on a shared machine
# with a load average of 3 to 10. Run it in the background:
#   nohup scripts/make_eval_docs.sh > /tmp/eval_docs.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
tmp=$(mktemp -d)
start=$(date +%s)

"$PY" -m kvtier eval passkey --lengths 2k,4k --samples 5 --seed 0 \
    --out "$tmp/passkey.json" --plot docs/passkey_smollm2.png
"$PY" -m kvtier eval niah --lengths 1k,2k,4k,8k --depths 0:100:25 --samples 2 --seed 0 \
    --out "$tmp/niah.json" --plot docs/niah_smollm2.png

"$PY" - "$tmp" "$start" <<'PY'
import json, sys, time
from pathlib import Path

tmp, start = Path(sys.argv[1]), int(sys.argv[2])
runs = [json.loads((tmp / f"{t}.json").read_text()) for t in ("passkey", "niah")]
doc = {"script": "scripts/make_eval_docs.sh", "wall_s": int(time.time()) - start, "runs": runs}
Path("docs/eval_results_smollm2.json").write_text(json.dumps(doc, indent=1) + "\n")
print(f"wrote docs/eval_results_smollm2.json ({doc['wall_s']} s)")
PY
