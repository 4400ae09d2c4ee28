#!/usr/bin/env bash
# The accelerator rows of docs/benchmarks.md, one run each, in one go (so a short GPU
# reservation measures them all). Usage:
#
#   CORPUS=DIR RUN=WORKDIR PARSE_RUN=WORKDIR ROWS="..." bash benchmarks/accelerator.sh [OUTDIR]
#
# Rows (ROWS: a space-separated subset, default all that can run):
#   big_bf16_corpus, base_bf16_corpus  configs/{big,base}.py train step (throughput.py) on the
#       first packed batch of a text corpus CORPUS (train/valid/test.{en,de}, e.g. from
#       ../shared/tools/make_wmt_sized.py), prepared once into PREPARED (default
#       OUTDIR/prepared) by the first of them; skipped without CORPUS.
#   big_bf16_512x64 (with --breakdown), big_bf16_256x128, big_bf16_1024x64,
#   big_bf16_512x64_triton_gemm, base_bf16_512x64, base_fp32_256x64  synthetic batches.
#   decode  benchmarks/decode.py (greedy and beam 4) on a trained run RUN (its --workdir), batches
#       of DECODE_BATCH_TOKENS source tokens (default the CPU default), its checkpoint
#       DECODE_CHECKPOINT (decode.py --checkpoint, default auto), its sentences DECODE_INPUT
#       (default: the run's test split); with CTranslate2 importable, CTranslate2 on the same
#       device and weights too (DECODE_ENGINES, default jax,ctranslate2 then, else jax; weight
#       types DECODE_QUANTIZATIONS, default float32,float16,bfloat16,int8); skipped without RUN.
#   parse  benchmarks/parse.py on a trained parsing run PARSE_RUN (its --workdir): its validation
#       sentences parsed at the widths PARSE_BEAMS (default 1,4), PARSE_BATCH_TOKENS source tokens
#       a batch (default 8192), its checkpoint PARSE_CHECKPOINT (default auto), the median of
#       PARSE_REPEATS warm calls (default 3); skipped without PARSE_RUN.
# Writes OUTDIR/results.jsonl (one {"name", "rc", "result"} line per run; result is the
# benchmark's JSON line, or null when it failed, with its stderr's tail in OUTDIR/errors.log) and
# prints one summary line per run. Each run is cut off after TIMEOUT seconds (default 300).
set -u
out=${1:-/tmp/accelerator_bench}
mkdir -p "$out"
out=$(cd "$out" && pwd)
logs=$(mktemp -d)
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=1
cd "$(dirname "$0")/.."
rows=" ${ROWS:-all} "

want() { [[ $rows == " all " || $rows == *" $1 "* ]]; }

record() {  # NAME RC: the JSON line of $logs/NAME.out into results.jsonl; 1 if there is none
  local name=$1 rc=$2 line
  line=$(grep '^{' "$logs/$name.out" | tail -1)
  echo "{\"name\": \"$name\", \"rc\": $rc, \"result\": ${line:-null}}" >>"$out/results.jsonl"
  if [[ -z $line ]]; then
    echo "$name: FAILED (rc $rc)"
    { echo "== $name"; tail -40 "$logs/$name.err"; } >>"$out/errors.log"
    return 1
  fi
  echo "$line" >"$logs/$name.json"
}

run() {  # NAME throughput.py-arguments...
  local name=$1; shift
  want "$name" || return 0
  timeout "${TIMEOUT:-300}" python3 benchmarks/throughput.py "$@" >"$logs/$name.out" \
    2>"$logs/$name.err"
  record "$name" $? || return 0
  python3 - "$name" "$logs/$name.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[2]))
ms, peak = r["step_time_s"] * 1e3, r["peak_flops"] / 1e12
nominal = r.get("mfu_nominal")
nominal = f"MFU {nominal:.3f} of {r['nominal_peak_flops'] / 1e12:.4g} nominal, " if nominal else ""
print(f"{sys.argv[1]}: {ms:.1f} ms/step, {r['tokens_per_s']:,.0f} target tokens/s, {nominal}"
      f"{r['mfu']:.3f} of {peak:.3g} TFLOP/s measured ({r['device']}, {r['dtype']},"
      f" batch {r['batch_shape']})")
PY
}

big=(--config configs/big.py)
base=(--config configs/base.py)
if [[ -n ${CORPUS:-} ]]; then
  corpus=(--config.data.source=text "--config.data.path=$CORPUS" --config.data.eval_split=valid
    "--config.data.cache_dir=${PREPARED:-$out/prepared}")
  run big_bf16_corpus "${big[@]}" "${corpus[@]}"
  run base_bf16_corpus "${base[@]}" "${corpus[@]}"
fi
run big_bf16_512x64 "${big[@]}" --batch_size=512 --seq_len=64 --breakdown
run big_bf16_256x128 "${big[@]}" --batch_size=256 --seq_len=128
run big_bf16_1024x64 "${big[@]}" --batch_size=1024 --seq_len=64
run big_bf16_512x64_triton_gemm "${big[@]}" --batch_size=512 --seq_len=64 --config.xla_flags=
run base_bf16_512x64 "${base[@]}" --batch_size=512 --seq_len=64
run base_fp32_256x64 "${base[@]}" --batch_size=256 --seq_len=64 --config.model.dtype=float32

if [[ -n ${RUN:-} ]] && want decode; then
  engines=jax
  python3 -c "import ctranslate2" 2>/dev/null && engines=jax,ctranslate2
  timeout "${TIMEOUT:-300}" python3 benchmarks/decode.py --workdir "$RUN" \
    --engines "${DECODE_ENGINES:-$engines}" \
    --quantizations "${DECODE_QUANTIZATIONS:-float32,float16,bfloat16,int8}" \
    --checkpoint "${DECODE_CHECKPOINT:-auto}" ${DECODE_INPUT:+--input "$DECODE_INPUT"} \
    ${DECODE_BATCH_TOKENS:+--batch_tokens "$DECODE_BATCH_TOKENS"} >"$logs/decode.out" \
    2>"$logs/decode.err"
  if record decode $?; then
    python3 - "$logs/decode.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
modes = ", ".join(f"{m} {r[m]['sentences_per_s']:,.0f} sentences/s" for m in ("greedy", "beam4"))
print(f"decode: {modes}, beam 4 / greedy time {r['beam4_over_greedy_time']} ({r['device']},"
      f" {r['batch_tokens']} source tokens a batch)")
ct2 = r.get("ctranslate2", {})
for t in ct2.values():
  if isinstance(t, dict):
    modes = ", ".join(f"{m} {t[m]['sentences_per_s']:,.0f} sentences/s" for m in ("greedy", "beam4"))
    print(f"decode, CTranslate2 {t['compute_type']} on {ct2['device']}: {modes}")
PY
  fi
fi
if [[ -n ${PARSE_RUN:-} ]] && want parse; then
  timeout "${TIMEOUT:-300}" python3 benchmarks/parse.py --workdir "$PARSE_RUN" \
    --checkpoint "${PARSE_CHECKPOINT:-auto}" --beam_sizes "${PARSE_BEAMS:-1,4}" \
    --batch_tokens "${PARSE_BATCH_TOKENS:-8192}" --repeats "${PARSE_REPEATS:-3}" \
    >"$logs/parse.out" 2>"$logs/parse.err"
  if record parse $?; then
    python3 - "$logs/parse.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
widths = sorted(int(k[4:]) for k in r if k.startswith("beam"))
modes = ", ".join(
    f"{'greedy' if b == 1 else f'beam {b}'} {r[f'beam{b}']['warm_sentences_per_s']:,.0f}"
    f" sentences/s (F1 {r[f'beam{b}']['f1']})" for b in widths)
print(f"parse: {modes} ({r['device']}, {r['sentences']} sentences, {r['batch_tokens']} source"
      " tokens a batch)")
PY
  fi
fi
rm -rf "$logs"
