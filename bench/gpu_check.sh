#!/usr/bin/env bash
# GPU check: the CUDA correctness tests, then `tokenmill bench offline --compare hf` with fp16 and
# CUDA graphs (and once without graphs, for the ratio), all in well under 8 minutes. Writes
# gpu_check.json (and the bench JSONs, pytest log) to the output directory.
#
#   bench/gpu_check.sh --prepare [DIR]   on a dev machine: copy what a bare GPU machine lacks (the
#                                        tokenizer of the tiny model) into DIR (default .gpu-carry)
#   bench/gpu_check.sh [OUT_DIR]         on the GPU machine, from the repository root
#                                        (default OUT_DIR: $OUT if set, else ./gpu-check)
#   bench/gpu_check.sh --cpu-dry-run [OUT_DIR]
#                                        the same steps on the CPU with 8 prompts (GPU tests skip):
#                                        checks the script itself before GPU minutes are spent on it
#
# The GPU machine needs python3 with torch (CUDA), transformers, numpy, tqdm, psutil, matplotlib,
# pytest and hypothesis; tokenmill runs from this checkout (PYTHONPATH), not installed, so its
# torch pin does not pull another torch. The tiny random Llama is built there from the carried
# tokenizer: the bundled default model's wheel is too big to carry.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python3
    [[ -x .venv/bin/python ]] && PYTHON=.venv/bin/python  # a dev checkout (a GPU machine has no .venv)
fi

if [[ "${1:-}" == "--prepare" ]]; then
    dest=${2:-.gpu-carry}
    mkdir -p "$dest/tokenizer"
    "$PYTHON" - "$dest/tokenizer" <<'EOF'
import sys
from transformers import AutoTokenizer
from tokenmill.models.hub import default_model_dir
AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(sys.argv[1])
print("tokenizer saved to", sys.argv[1])
EOF
    exit 0
fi

dry_run=0
num_prompts=64
if [[ "${1:-}" == "--cpu-dry-run" ]]; then
    dry_run=1
    num_prompts=8
    shift
fi
out=${1:-${OUT:-gpu-check}}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [[ $dry_run == 0 ]] && ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: no CUDA device visible to $PYTHON (torch.cuda.is_available() is False)" >&2
    exit 3
fi
tokenizer=${TOKENMILL_TEST_TOKENIZER:-.gpu-carry/tokenizer}
if [[ ! -f "$tokenizer/tokenizer.json" ]]; then
    echo "gpu_check: no tokenizer at $tokenizer: run 'bench/gpu_check.sh --prepare' on a dev machine first" >&2
    exit 2
fi
export TOKENMILL_TEST_TOKENIZER="$tokenizer" TOKENMILL_CACHE="${TOKENMILL_CACHE:-/tmp/tokenmill-cache}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" || true
start=$(date +%s)

echo "== correctness tests on CUDA"
set +e
timeout 240 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_gpu.py > "$out/pytest.log" 2>&1
tests_rc=$?
set -e
tail -n 15 "$out/pytest.log"

echo "== bench offline --compare hf, fp16 (with and without CUDA graphs)"
tiny=/tmp/tokenmill-gpu-tiny
[[ -f "$tiny/config.json" ]] || "$PYTHON" -m tokenmill.cli make-tiny-model "$tiny" --tokenizer "$tokenizer" > /dev/null
bench=("$PYTHON" -m tokenmill.cli bench offline --model "$tiny" --dtype float16 --no-progress --kv-cache-memory 4GiB
       --num-prompts "$num_prompts")
set +e
timeout 150 "${bench[@]}" --compare hf --cuda-graphs --json "$out/bench_graphs.json" > "$out/bench_graphs.txt" 2>&1
graphs_rc=$?
timeout 90 "${bench[@]}" --no-cuda-graphs --json "$out/bench_eager.json" > "$out/bench_eager.txt" 2>&1
eager_rc=$?
set -e
cat "$out/bench_graphs.txt" "$out/bench_eager.txt" | grep -v '^\s*$' | tail -n 40

"$PYTHON" - "$out" "$tests_rc" "$graphs_rc" "$eager_rc" "$(( $(date +%s) - start ))" <<'EOF'
import json, pathlib, re, sys
out, tests_rc, graphs_rc, eager_rc, seconds = sys.argv[1], *map(int, sys.argv[2:])
d = pathlib.Path(out)
log = (d / "pytest.log").read_text()
counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", log.splitlines()[-1] if log else "")}
def load(name):
    p = d / name
    return json.loads(p.read_text()) if p.exists() else None
report = {"gpu": (d / "gpu.txt").read_text().strip() if (d / "gpu.txt").exists() else None,
          "seconds": seconds, "tests": {"rc": tests_rc, **counts},
          "bench_cuda_graphs": {"rc": graphs_rc, "result": load("bench_graphs.json")},
          "bench_eager": {"rc": eager_rc, "result": load("bench_eager.json")}}
(d / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
print(f"gpu_check: tests rc={tests_rc} {counts}, bench rc={graphs_rc}/{eager_rc}, {seconds} s -> {d / 'gpu_check.json'}")
sys.exit(1 if tests_rc or graphs_rc or eager_rc else 0)
EOF
