#!/bin/bash
# The GPU check on a lent device machine (torch and CUDA there, no vLLM, no package index).
#   here:  bash benchmarks/gpu_run.sh prepare     (wheels of what the machine's image lacks, into .whl/)
#   there: bash benchmarks/gpu_run.sh             (carry .whl; figures in $OUT, a summary on stdout)
set -u
cd "$(dirname "$0")/.."
if [ "${1:-}" = prepare ]; then
    grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d .whl pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
        typing-inspection==0.4.5 typing_extensions==4.16.0
    exit
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/kvtier-gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
lscpu | grep -E "Model name|^CPU\(s\)"
timeout 300 python3 -m kvtier.bench.gpu_check >"$OUT/gpu_check.json" 2>"$OUT/gpu_check.err"; echo "gpu_check rc=$?"
tail -5 "$OUT/gpu_check.err"
python3 - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/gpu_check.json"))
for k in ("device", "torch", "pinned", "ordering", "exact", "ok"):
    print(k, r.get(k))
def flat(d, depth=0):
    for k, v in d.items():
        if k == "error":
            print("  " * depth + "ERROR", v[-2000:])
        elif k == "profile":
            print("\n".join(v))
        elif isinstance(v, dict):
            print("  " * depth + k); flat(v, depth + 1)
        elif not isinstance(v, list):
            print("  " * depth + f"{k}: {v}")
for name in [k for k in r if k.startswith(("speed", "pages", "gaps"))]:
    print("==", name); flat(r[name], 1)
PY
