#!/usr/bin/env bash
# One prepared run on a GPU machine (about 15 minutes of GPU time): checks what is installed,
# runs the CUDA test subset, then the benchmarks, appending every figure to one Markdown file.
#
#   bash benchmarks/gpu.sh [PART...]   # PART: tests attention llama qwen (default: all four, in that order)
#
# Figures are appended to $OUT/gpu_figures.md (benchmarks/ without $OUT). Where one command may
# run 10 minutes at most, run the parts as separate commands on the same machine, most important
# first: `gpu.sh tests attention` (at most 7 min), `gpu.sh llama` (at most 8), `gpu.sh qwen` (4);
# the limits are worst cases, each stage's own. Triton's compile cache carries between them.
#
# What it assumes of the machine (issue 21): Python with torch (CUDA), triton and transformers
# already installed, nothing fetchable. So nothing here reinstalls torch or triton: slipstream
# runs from the source tree (PYTHONPATH), and packages that are missing are installed from
# wheels carried in $WHEELS (default benchmarks/out/wheels, made by gpu_wheels.sh and carried
# with the run), without an index; what is already installed stays. Model files do not
# travel: the benchmarks build random-weight checkpoints of real shapes on the GPU.
#
# Stages run in order of importance, each under its own time limit, and a failing stage does
# not stop the next: its failure is written to the figures file instead.
set -u -o pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-python3}
WHEELS=${WHEELS:-benchmarks/out/wheels}
WORK=${WORK:-/tmp/slipstream-gpu}
RESULTS=${OUT:-$ROOT/benchmarks}/gpu_figures.md
PARTS=${*:-tests attention llama qwen}
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export TOKENIZERS_PARALLELISM=false
mkdir -p "$WORK" "$(dirname "$RESULTS")"
BENCH=("$PY" benchmarks/gpu_bench.py)

note() { echo "$*" | tee -a "$RESULTS"; }

# stage NAME SECONDS COMMAND...: run with a time limit; its output goes to $WORK/NAME.log
stage() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "=== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$WORK/$name.log"
    if [ $rc -ne 0 ]; then
        note "- $name: FAILED (exit $rc after $((SECONDS - start)) s; last lines below)"
        tail -n 15 "$WORK/$name.log" | sed 's/^/    /' >> "$RESULTS"
    fi
    echo "=== $name: exit $rc, $((SECONDS - start)) s"
    return 0
}

wants() { [[ " $PARTS " == *" $1 "* ]]; }

# --- the machine -----------------------------------------------------------------------
note ""
note "# slipstream: $PARTS on $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1)"
note ""
note "- $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
note "- $("$PY" -c 'import sys, torch, triton, transformers; print(f"Python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, transformers {transformers.__version__}")' 2>&1)"

if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl > /dev/null 2>&1; then
    note "- installing what is missing from the carried wheels: $(cd "$WHEELS" && ls *.whl | tr '\n' ' ')"
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" xgrammar gguf pytest pytest-timeout 2>&1 | tail -n 5
fi
MISSING=$("$PY" - <<'EOF'
import importlib.util
needed = ["torch", "triton", "transformers", "safetensors", "tokenizers", "gguf", "numpy", "jinja2", "xgrammar",
          "pytest"]
print(" ".join(name for name in needed if importlib.util.find_spec(name) is None))
EOF
)
[ -n "$MISSING" ] && note "- missing packages (carry their wheels in $WHEELS): $MISSING"
if ! "$PY" -c "import slipstream.llm" > "$WORK/import.log" 2>&1; then
    note "- slipstream does not import; nothing else can run:"
    tail -n 15 "$WORK/import.log" | sed 's/^/    /' >> "$RESULTS"
    exit 1
fi
note ""

# --- correctness first: the GPU tests (kernels compiled for this GPU, graphs, memory profiling)
if wants tests; then
    # not the slow compile-only test: here every kernel is compiled (and run) by the others
    stage tests 300 "$PY" -m pytest -q -p no:cacheprovider -m "not slow" tests/gpu
    note "- tests/gpu: $(tail -n 1 "$WORK/tests.log")"
fi

# --- attention alone: TurboQuant codes vs the bf16 cache (no checkpoint needed) ----------
if wants attention; then
    note ""
    note "## Decode attention (one layer of Llama-3.1-8B: 32 query / 8 KV heads, head size 128)"
    stage tq-attention 120 "${BENCH[@]}" tq-attention --results "$RESULTS"
fi

# --- Llama-3.1-8B, random weights: offline throughput and single-stream decode ---------
LLAMA=$WORK/llama-3.1-8b
if wants llama; then
    note ""
    note "## Llama-3.1-8B (random weights, real shapes)"
    [ -f "$LLAMA/config.json" ] || stage llama-checkpoint 120 "${BENCH[@]}" checkpoint --config llama-3.1-8b \
        --out "$LLAMA" --results "$RESULTS"
    if [ -f "$LLAMA/config.json" ]; then
        stage llama-throughput 110 "${BENCH[@]}" throughput --model "$LLAMA" --label llama-3.1-8b \
            --engine slipstream --results "$RESULTS"
        stage llama-throughput-hf 110 "${BENCH[@]}" throughput --model "$LLAMA" --label llama-3.1-8b \
            --engine transformers --results "$RESULTS"
        stage llama-latency 150 "${BENCH[@]}" latency --model "$LLAMA" --label llama-3.1-8b --input-len 128 \
            --output-len 256 --with-transformers --results "$RESULTS"
    fi
fi

# --- Qwen3-30B-A3B's layer shapes (8 of its 48 layers: the disk and the time allow no more) ---
QWEN=$WORK/qwen3-30b-a3b
if wants qwen; then
    note ""
    note "## Qwen3-30B-A3B, first 8 of 48 layers (random weights, real layer shapes)"
    [ -f "$QWEN/config.json" ] || stage qwen-checkpoint 90 "${BENCH[@]}" checkpoint --config qwen3-30b-a3b \
        --layers 8 --out "$QWEN" --results "$RESULTS"
    if [ -f "$QWEN/config.json" ]; then
        stage qwen-throughput 80 "${BENCH[@]}" throughput --model "$QWEN" --label qwen3-30b-a3b-8l \
            --engine slipstream --num-prompts 128 --results "$RESULTS"
        stage qwen-throughput-hf 80 "${BENCH[@]}" throughput --model "$QWEN" --label qwen3-30b-a3b-8l \
            --engine transformers --num-prompts 128 --results "$RESULTS"
        rm -rf "$QWEN"
    fi
fi

note ""
note "- $PARTS: wall time $SECONDS s; logs in $WORK"
cp "$WORK"/*.log "$(dirname "$RESULTS")"/ 2>/dev/null || true
