#!/usr/bin/env bash
# The GPU check of issue 49: the quick profile on CUDA, then notebook 04's timing up to 64k tokens in bf16, and a
# report in reports/gpu/<date>-<gpu>/ (README.md, the runner's logs, 04's CSVs and metrics). From the repository
# root, after `make setup`:
#   scripts/gpu_check.sh                        # 04 on SmolLM2-135M (notebooks/profiles/gpu-timing.yaml)
#   TIMING_PROFILE=paper scripts/gpu_check.sh   # 04 on Llama-3.1-8B (paper.yaml; needs the Hub model)
# PYTHON overrides the interpreter (default .venv/bin/python). Exit 1 if a notebook failed (the report is written).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
TIMING=${TIMING_PROFILE:-gpu-timing}
die() { echo "gpu_check: $*" >&2; exit 1; }

# ---- CUDA or nothing: each check fails in one line before anything runs or is written
command -v nvidia-smi >/dev/null || die "no nvidia-smi: this check needs an NVIDIA GPU and its driver"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1) || true
[ -n "$GPU" ] || die "nvidia-smi lists no GPU"
[ -x "$PY" ] || die "no $PY: run make setup first, or set PYTHON"
"$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null \
  || die "torch sees no CUDA device ($("$PY" -c 'import torch; print(torch.__version__)' 2>&1 | tail -n 1)): install a CUDA build of torch"

# ---- what ran where
DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1)
VERSIONS=$("$PY" -c 'import torch, transformers; print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}")')
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD 2>/dev/null || [ "$COMMIT" = unknown ] || COMMIT="$COMMIT (with uncommitted changes)"
OUT=reports/gpu/$(date +%F)-$(echo "$GPU" | tr -cs 'A-Za-z0-9' '-' | sed 's/-$//')
mkdir -p "$OUT"

# ---- the runs: a failed notebook is reported, not fatal
status=0
"$PY" -m harp_src.runner --profile quick-cuda 2>&1 | tee "$OUT/quick-cuda.log" || status=1
touch "$OUT/.start"  # 04's files older than this are an earlier run's, not copied
"$PY" -m harp_src.runner --profile "$TIMING" --only 04 2>&1 | tee "$OUT/timing-$TIMING.log" || status=1
find .runs/"$TIMING"/figures -maxdepth 1 -name '04_*' \( -name '*.csv' -o -name '*_metrics.json' \) \
  -newer "$OUT/.start" -exec cp {} "$OUT"/ \; 2>/dev/null || status=1
rm -f "$OUT/.start"

# ---- the report
{
  echo "# GPU check: $GPU"
  echo
  echo "- $(date -u '+%F %H:%M UTC') on ${HOSTNAME:-?}; GPU: $GPU, driver $DRIVER"
  echo "- $VERSIONS; commit $COMMIT"
  echo "- \`scripts/gpu_check.sh\` (TIMING_PROFILE=$TIMING); exit status $status"
  for log in quick-cuda "timing-$TIMING"; do
    echo; echo "## \`$log\`: the runner's summary"; echo; echo '```'
    sed -n '/^notebook /,$p' "$OUT/$log.log"
    echo '```'
  done
  echo; echo "## 04: speed-up of HARP over dense, measured and the FLOP bound"; echo
  "$PY" - "$OUT/04_speedup.csv" <<'PYEOF' || echo "(no 04_speedup.csv: see the timing log)"
import sys, pandas as pd
t = pd.read_csv(sys.argv[1])[["model", "device", "seq_len", "speedup", "flop_bound", "decode_speedup"]]
print("| " + " | ".join(t.columns) + " |\n|" + "---|" * len(t.columns))
for row in t.itertuples(index=False):
    print("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row) + " |")
PYEOF
} > "$OUT/README.md"
echo "gpu_check: report in $OUT/README.md"
exit "$status"
