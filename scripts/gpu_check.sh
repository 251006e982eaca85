#!/usr/bin/env bash
# The GPU check of issue 49: the exact invariants and precision tests on CUDA (`pytest --device cuda`), the quick
# profile on CUDA, then notebook 04's timing up to 64k tokens in bf16, and a report in reports/gpu/<date>-<gpu>/
# (README.md, the logs, 04's CSVs and metrics). From the repository root, after `make setup`:
#   scripts/gpu_check.sh                        # 04 on SmolLM2-135M (notebooks/profiles/gpu-timing.yaml)
#   TIMING_PROFILE=paper scripts/gpu_check.sh   # 04 on Llama-3.1-8B (paper.yaml; needs the Hub model)
#   GPU_CHECK_PARTS=tests scripts/gpu_check.sh  # the tests alone: tiny models, no packaged model needed
# PYTHON overrides the interpreter (default .venv/bin/python). GPU_CHECK_PARTS picks among "tests quick timing" (all
# three by default). Exit 1 if a test or a notebook failed (the report is written).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
TIMING=${TIMING_PROFILE:-gpu-timing}
PARTS=${GPU_CHECK_PARTS:-tests quick timing}
die() { echo "gpu_check: $*" >&2; exit 1; }
set -f  # the parts are words, never file patterns
for part in $PARTS; do
  case $part in tests|quick|timing) ;; *) die "GPU_CHECK_PARTS: unknown part '$part' (choose among: tests quick timing)";; esac
done
set +f
[[ $PARTS = *[![:space:]]* ]] || die "GPU_CHECK_PARTS is empty (choose among: tests quick timing)"
# the test files with tests that take `device` (tests/test_paper_profile.py checks this list against pytest's)
DEVICE_TESTS="tests/test_harp.py tests/test_keep_heads.py tests/test_mean_bypass.py tests/test_precision.py"
runs() { case " $PARTS " in *" $1 "*) return 0;; *) return 1;; esac; }

# ---- CUDA or nothing: each check fails in one line before anything runs or is written
command -v nvidia-smi >/dev/null || die "no nvidia-smi: this check needs an NVIDIA GPU and its driver"
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1) || true
[ -n "$GPU" ] || die "nvidia-smi lists no GPU"
command -v "$PY" >/dev/null || die "no $PY: run make setup first, or set PYTHON"
"$PY" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null \
  || die "torch sees no CUDA device ($("$PY" -c 'import torch; print(torch.__version__)' 2>&1 | tail -n 1)): install a CUDA build of torch"

# ---- what ran where
DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1)
VERSIONS=$("$PY" -c 'import torch, transformers; print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}")')
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD 2>/dev/null || [ "$COMMIT" = unknown ] || COMMIT="$COMMIT (with uncommitted changes)"
OUT=reports/gpu/$(date +%F)-$(echo "$GPU" | tr -cs 'A-Za-z0-9' '-' | sed 's/-$//')
mkdir -p "$OUT"

# ---- the runs: a failed test or notebook is reported, not fatal
status=0
if runs tests; then
  # shellcheck disable=SC2086  # four file names, no spaces
  "$PY" -m pytest -q -p no:cacheprovider --device cuda $DEVICE_TESTS 2>&1 | tee "$OUT/tests-cuda.log" || status=1
fi
if runs quick; then
  "$PY" -m harp_src.runner --profile quick-cuda 2>&1 | tee "$OUT/quick-cuda.log" || status=1
fi
if runs timing; then
  touch "$OUT/.start"  # 04's files older than this are an earlier run's, not copied
  "$PY" -m harp_src.runner --profile "$TIMING" --only 04 2>&1 | tee "$OUT/timing-$TIMING.log" || status=1
  find .runs/"$TIMING"/figures -maxdepth 1 -name '04_*' \( -name '*.csv' -o -name '*_metrics.json' \) \
    -newer "$OUT/.start" -exec cp {} "$OUT"/ \; 2>/dev/null || status=1
  rm -f "$OUT/.start"
fi

# ---- the report
{
  echo "# GPU check: $GPU"
  echo
  echo "- $(date -u '+%F %H:%M UTC') on ${HOSTNAME:-?}; GPU: $GPU, driver $DRIVER"
  echo "- $VERSIONS; commit $COMMIT"
  echo "- \`scripts/gpu_check.sh\` (GPU_CHECK_PARTS=\"$PARTS\", TIMING_PROFILE=$TIMING); exit status $status"
  if runs tests; then
    echo; echo "## \`pytest --device cuda\`: exact invariants and precision on tiny models"; echo; echo '```'
    if grep -q 'short test summary info' "$OUT/tests-cuda.log"; then
      sed -n '/short test summary info/,$p' "$OUT/tests-cuda.log"
    else
      tail -n 1 "$OUT/tests-cuda.log"
    fi
    echo '```'
  fi
  for log in quick-cuda "timing-$TIMING"; do
    if [ "$log" = quick-cuda ]; then runs quick || continue; else runs timing || continue; fi
    echo; echo "## \`$log\`: the runner's summary"; echo; echo '```'
    sed -n '/^notebook /,$p' "$OUT/$log.log"
    echo '```'
  done
  if runs timing; then
  echo; echo "## 04: speed-up of HARP over dense, measured and the FLOP bound"; echo
  "$PY" - "$OUT/04_speedup.csv" <<'PYEOF' || echo "(no 04_speedup.csv: see the timing log)"
import sys, pandas as pd
t = pd.read_csv(sys.argv[1])[["model", "device", "seq_len", "speedup", "flop_bound", "decode_speedup"]]
print("| " + " | ".join(t.columns) + " |\n|" + "---|" * len(t.columns))
for row in t.itertuples(index=False):
    print("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row) + " |")
PYEOF
  fi
} > "$OUT/README.md"
echo "gpu_check: report in $OUT/README.md"
exit "$status"
