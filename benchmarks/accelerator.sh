#!/usr/bin/env bash
# The README's accelerator rows of benchmarks/throughput.py, one run each, in one go (so a short
# GPU reservation measures them all). Usage: bash benchmarks/accelerator.sh [OUTDIR]
# Writes OUTDIR/results.jsonl (one {"name", "rc", "result"} line per run; result is the
# benchmark's JSON line, or null when it failed, with its stderr's tail in OUTDIR/errors.log) and
# prints one summary line per run.
set -u
out=${1:-/tmp/accelerator_bench}
mkdir -p "$out"
logs=$(mktemp -d)
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
cd "$(dirname "$0")/.."

run() {  # NAME throughput.py-arguments...
  local name=$1; shift
  timeout 300 python3 benchmarks/throughput.py "$@" >"$logs/$name.out" 2>"$logs/$name.err"
  local rc=$? line
  line=$(grep '^{' "$logs/$name.out" | tail -1)
  echo "{\"name\": \"$name\", \"rc\": $rc, \"result\": ${line:-null}}" >>"$out/results.jsonl"
  if [[ -z $line ]]; then
    echo "$name: FAILED (rc $rc)"
    { echo "== $name"; tail -40 "$logs/$name.err"; } >>"$out/errors.log"
    return
  fi
  python3 - "$name" "$line" <<'PY'
import json, sys
r = json.loads(sys.argv[2])
ms, peak = r["step_time_s"] * 1e3, r["peak_flops"] / 1e12
print(f"{sys.argv[1]}: {ms:.1f} ms/step, {r['tokens_per_s']:,.0f} target tokens/s,"
      f" MFU {r['mfu']:.3f} of {peak:.3g} TFLOP/s ({r['device']}, {r['dtype']})")
PY
}

big=(--config configs/big.py)
base=(--config configs/base.py)
run big_bf16_512x64 "${big[@]}" --batch_size=512 --seq_len=64 --breakdown
run big_bf16_256x128 "${big[@]}" --batch_size=256 --seq_len=128
run big_bf16_1024x64 "${big[@]}" --batch_size=1024 --seq_len=64
run big_bf16_512x64_triton_gemm "${big[@]}" --batch_size=512 --seq_len=64 --config.xla_flags=
run base_bf16_512x64 "${base[@]}" --batch_size=512 --seq_len=64
run base_fp32_256x64 "${base[@]}" --batch_size=256 --seq_len=64 --config.model.dtype=float32
rm -rf "$logs"
