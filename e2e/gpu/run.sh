#!/usr/bin/env bash
# The GPU runs of rota's benchmark with real vLLM 0.26, one command per stage, each within
# one call of at most ~9.5 minutes on a GPU machine with no network.
#
#   e2e/gpu/run.sh piece0    copy the first piece of the offline vLLM bundle to the machine,
#                            report the environment, measure the copy floors, write B's
#                            real weight files
#   e2e/gpu/run.sh bench     (alias install+bench) add the second piece, install the bundle,
#                            run the scenarios that leave every engine alive, the real-GPU
#                            pytest on those engines, then the next scenarios while time is
#                            left; the engines stay up (own sessions) for the next stage
#   e2e/gpu/run.sh more      the scenarios not run yet, on the running engines
#   e2e/gpu/run.sh policy    (after piece0, or after a call that only copied the first
#                            piece into $WORK/chunks) add the second piece, install the
#                            bundle, start three engines of model-small and replay three
#                            windows of the Azure trace through the lease controller's GPU
#                            worker: all engines awake (the bound), first-come, drain, rota
#                            (python -m e2e.gpu.policy_run; ROTA_POLICY_ARGS: more arguments,
#                            e.g. --engines 5, --kv 30Gi, --windows 2); results in
#                            $OUT/policy.json
#   e2e/gpu/run.sh keep      (after piece0, like policy) add the second piece, install the
#                            bundle, start one engine of model-small and probe which call
#                            sequence keeps in-flight streams across a level-1 sleep, then
#                            sleep/wake cycles with streams frozen by keep (python -m
#                            e2e.gpu.keep_probe; ROTA_KEEP_ARGS: more arguments, e.g.
#                            --cycles 300); results in $OUT/keep.json
#   e2e/gpu/run.sh stop      stop every engine of the state
#   e2e/gpu/run.sh status    the state, the GPU, the engines' health
#
# Inputs (ignored paths of the checkout, carried by the caller): .vllm/bundle/ (the pieces
# wheels.tar.xz.part-00 / -01, SHA256SUMS, WHOLE.sha256 built by the bundle script),
# .vllm/models/{model-14b,model-small} (config + tokenizer), optionally .vllm/whl/ (wheels
# for rota itself, e.g. protobuf or the kubernetes client and its dependencies, installed
# only when rota's imports fail).
# Outputs: $OUT/<stage>.log (everything printed), $OUT/<run>.json (the results, rewritten
# after every step; the bench stage has two runs, bench and bench2), $OUT/<run>-nvml.json
# (the NVML timeline), $OUT/<stage>-engines.log (the engines' own logs, cut), $OUT/prep.json
# (piece0), $OUT/pytest-gpu.log (bench).
# Knobs: ROTA_GPU_BUDGET_S (570: seconds this command may take), ROTA_GPU_SCENARIOS (the
# scenarios to run, comma-separated; by default bench runs the harmless ones, then the next
# ones, and more the ones not run yet), ROTA_BENCH_ARGS (more arguments of the benchmark,
# not --scenarios), ROTA_GPU_WORK (/tmp/vllm: chunks, wheels), ROTA_GPU_SITE (/tmp/site:
# vLLM), ROTA_GPU_STATE (/tmp/rota-gpu: engines' state and logs), ROTA_GPU_INPUT (.vllm of
# the checkout), ROTA_POLICY_ARGS / ROTA_KEEP_ARGS (more arguments of those stages), PY
# (python3).
set -uo pipefail
STAGE=${1:?usage: e2e/gpu/run.sh piece0|bench|more|policy|keep|stop|status}
[ "$STAGE" = "install+bench" ] && STAGE=bench
BEGAN=$(date +%s)
BUDGET=${ROTA_GPU_BUDGET_S:-570}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
INPUT=${ROTA_GPU_INPUT:-$REPO/.vllm}
WORK=${ROTA_GPU_WORK:-/tmp/vllm}
SITE=${ROTA_GPU_SITE:-/tmp/site}
ROTA_SITE=${ROTA_GPU_ROTA_SITE:-/tmp/rota-site}
STATE=${ROTA_GPU_STATE:-/tmp/rota-gpu}
PY=${PY:-python3}
OUT=${OUT:-$INPUT/out}
mkdir -p "$OUT" "$WORK/chunks" "$STATE"
LOG="$OUT/$STAGE.log"
exec > >(tee -a "$LOG") 2>&1
TEE=$!
trap 'exec 1>&- 2>&-; wait "$TEE" 2>/dev/null' EXIT
export PYTHONUNBUFFERED=1  # (bytecode is written: engines started later import vLLM faster)

say() { echo "[$(( $(date +%s) - BEGAN ))s] $*"; }
left() { echo $(( BUDGET - ($(date +%s) - BEGAN) )); }
die() { say "FAILED: $*"; exit 1; }

copy_piece() {  # copy_piece NAME: a carried piece (and the sums) into $WORK/chunks
  local name=$1
  [ -f "$INPUT/bundle/$name" ] || die "$INPUT/bundle/$name was not carried with this call"
  cp "$INPUT/bundle/$name" "$WORK/chunks/" || die "cannot copy $name"
  for f in SHA256SUMS WHOLE.sha256; do
    [ -f "$INPUT/bundle/$f" ] && cp "$INPUT/bundle/$f" "$WORK/chunks/"
  done
  say "$name in $WORK/chunks ($(stat -c %s "$WORK/chunks/$name") bytes)"
}

environment() {
  say "machine: $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB memory, boot $(cat /proc/sys/kernel/random/boot_id)"
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader || true
  PYTHONPATH="$SITE" "$PY" - <<'EOF'
import sys
from importlib import metadata
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "transformers", "protobuf", "grpcio", "aiohttp", "pydantic",
             "nvidia-ml-py", "prometheus-client", "pytest", "vllm"):
    try:
        print(f"  {name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(f"  {name}: not installed")
EOF
}

rota_path() {  # PYTHONPATH of rota's own processes: extra wheels, the checkout, the bundle
  echo "$ROTA_SITE:$REPO:$SITE"
}

ensure_rota_imports() {
  # policy_run imports the lease controller's GPU worker, and with it the kubernetes client
  if PYTHONPATH=$(rota_path) "$PY" -c "import e2e.gpu.bench, e2e.gpu.policy_run" 2>"$STATE/import.err"; then
    return 0
  fi
  say "rota does not import: $(tail -n 1 "$STATE/import.err")"
  if ls "$INPUT"/whl/*.whl >/dev/null 2>&1; then
    say "installing the carried wheels for rota into $ROTA_SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$ROTA_SITE" "$INPUT"/whl/*.whl || die "pip could not install .vllm/whl"
  fi
  PYTHONPATH=$(rota_path) "$PY" -c "import e2e.gpu.bench, e2e.gpu.policy_run" \
    || die "rota still does not import (carry the missing wheels in .vllm/whl)"
}

weights() {  # real weight files for model-small (level 2 reloads them)
  local dst="$STATE/weights/model-small"
  if ls "$dst"/*.safetensors >/dev/null 2>&1; then say "weights of model-small already in $dst"; return 0; fi
  say "writing random weights for model-small into $dst"
  mkdir -p "$STATE/weights"
  timeout 120 env PYTHONPATH="$REPO" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PY" -m e2e.gpu.weights "$INPUT/models/model-small" "$dst" \
    || say "weights not written: B runs on dummy weights and level 2 is skipped"
}

h2d() {  # the copy floors, once per machine (GPU memory must be free: before the engines)
  if [ -s "$STATE/h2d.json" ] && grep -q '"bulk"' "$STATE/h2d.json"; then say "copy floors already measured"; return 0; fi
  say "measuring the host-to-device copy floors"
  timeout 150 env PYTHONPATH="$REPO" "$PY" -m e2e.gpu.h2d --model "$INPUT/models/model-14b" \
    --model "$INPUT/models/model-small" --kv-bytes 8Gi --out "$STATE/h2d.json" \
    || say "the copy floor measurement failed (the benchmark assumes 54e9 B/s)"
}

install_bundle() {
  if [ -f "$SITE/vllm/__init__.py" ] && [ -f "$WORK/installed" ]; then say "vLLM already installed in $SITE"; return 0; fi
  [ -f "$WORK/chunks/wheels.tar.xz.part-00" ] \
    || die "the first piece is not on this machine (it went back and came up fresh since the piece0 call): run piece0 again, then this stage"
  (cd "$WORK/chunks" && sha256sum -c SHA256SUMS) || die "a piece is damaged (sha256)"
  (cd "$WORK/chunks" && cat wheels.tar.xz.part-* | sha256sum | awk '{print $1"  wheels.tar.xz"}' | diff - WHOLE.sha256) \
    || die "the joined bundle does not match WHOLE.sha256"
  rm -rf "$WORK/whl" && mkdir -p "$WORK/whl"
  if command -v xz >/dev/null 2>&1; then
    cat "$WORK"/chunks/wheels.tar.xz.part-* | xz -dc -T0 | tar -C "$WORK/whl" -xf - || die "unpacking failed"
  else
    cat "$WORK"/chunks/wheels.tar.xz.part-* | "$PY" -c "import lzma,sys,tarfile; tarfile.open(fileobj=lzma.open(sys.stdin.buffer),mode='r|').extractall(sys.argv[1],filter='data')" "$WORK/whl" || die "unpacking failed"
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WORK"/whl/*.whl \
    || die "pip could not install the bundle"
  # Bytecode on all cores now, as an image would hold it, instead of inside each cold start.
  timeout 90 "$PY" -m compileall -q -j 0 "$SITE" >/dev/null 2>&1 || say "compileall did not finish (engines compile what they import)"
  touch "$WORK/installed"
  say "installed $(ls "$WORK/whl" | wc -l) wheels into $SITE: vllm $(PYTHONPATH=$SITE "$PY" -c 'import vllm; print(vllm.__version__)' 2>/dev/null)"
}

bench() {  # bench STAGE SCENARIOS
  local stage=$1 scenarios=$2 budget
  budget=$(( $(left) - 30 ))
  [ "$budget" -gt 60 ] || die "only $(left) s left: not enough for the benchmark"
  say "benchmark stage $stage, scenarios $scenarios, $budget s"
  local h2d_arg=()
  [ -s "$STATE/h2d.json" ] && h2d_arg=(--h2d-json "$STATE/h2d.json")
  # shellcheck disable=SC2086
  timeout -k 15 $(( budget + 10 )) env PYTHONPATH="$(rota_path)" ROTA_VLLM_PYTHONPATH="$SITE" \
    "$PY" -m e2e.bench.gpu --engine vllm --stage "$stage" --out "$OUT" --state-dir "$STATE" \
    --models "$INPUT/models" --scenarios "$scenarios" --deadline-s "$budget" \
    --keep-engines --vllm-python "$(command -v "$PY")" "${h2d_arg[@]}" ${ROTA_BENCH_ARGS:-}
  local rc=$?
  say "benchmark exited with status $rc"
  return $rc
}

gpu_pytest() {  # the real-GPU pytest, on the running engines, when two run and time is left
  local live
  live=$(PYTHONPATH="$(rota_path)" "$PY" -m e2e.gpu.engines status "$STATE" | grep -c " alive,")
  if [ "$(left)" -lt 150 ] || [ "$live" -lt 2 ]; then
    say "no real-GPU pytest: $(left) s left, $live engines running (it needs 150 s and two)"
    return 0
  fi
  say "real-GPU pytest on the running engines ($(left) s left)"
  # 110 s: the test's own benchmark ends within 75 s, before the next run drives the engines.
  timeout -k 10 110 env PYTHONPATH="$(rota_path)" ROTA_VLLM_PYTHONPATH="$SITE" \
    ROTA_GPU_STATE="$STATE" ROTA_GPU_MODELS="$INPUT/models" \
    "$PY" -m pytest -q -rs -m gpu --noconftest -p no:cacheprovider -o addopts="" \
    -o filterwarnings=ignore::DeprecationWarning -W "ignore::pytest.PytestConfigWarning" \
    --rootdir "$REPO" "$REPO/tests/gpu/test_vllm_gpu.py" 2>&1 | tee "$OUT/pytest-gpu.log"
  say "real-GPU pytest exited with status ${PIPESTATUS[0]}"
}

engine_logs() {  # engine_logs STAGE [DIR]: the engines' logs, the last 1.5 MiB of each
  local stage=$1 dir=${2:-$STATE} f
  : > "$OUT/$stage-engines.log"
  for f in "$dir"/engine-*.log; do
    [ -f "$f" ] || continue
    { echo "===== $(basename "$f") ($(stat -c %s "$f") bytes, last 1.5 MiB)"; tail -c 1572864 "$f"; echo; } >> "$OUT/$stage-engines.log"
  done
}

case "$STAGE" in
  piece0)
    environment
    copy_piece wheels.tar.xz.part-00
    weights
    h2d
    PYTHONPATH="$REPO" "$PY" - "$STATE" "$OUT/prep.json" <<'EOF'
import json, pathlib, sys
state = pathlib.Path(sys.argv[1])
out = {"h2d": None, "weights": sorted(p.name for p in (state / "weights" / "model-small").glob("*"))
       if (state / "weights" / "model-small").is_dir() else []}
try:
    out["h2d"] = json.loads((state / "h2d.json").read_text())
except (OSError, ValueError) as exc:
    out["h2d_error"] = str(exc)
pathlib.Path(sys.argv[2]).write_text(json.dumps(out, indent=1))
print(json.dumps({"bulk_h2d_GBps": round((out["h2d"] or {}).get("bulk", {}).get("best_bytes_per_s", 0) / 1e9, 2),
                  "weights": out["weights"]}))
EOF
    say "piece0 done in $(( $(date +%s) - BEGAN )) s: call the bench stage within 30 s (the machine goes back when idle)"
    ;;
  bench)
    environment
    copy_piece wheels.tar.xz.part-01
    install_bundle
    ensure_rota_imports
    weights
    h2d
    # The scenarios that leave every engine alive, the real-GPU pytest on those engines, then
    # the rest in order while time is left (ROTA_GPU_SCENARIOS: only the ones it names).
    bench bench "${ROTA_GPU_SCENARIOS:-startup,main,wake_detail,level2}"
    rc=$?
    gpu_pytest
    if [ -z "${ROTA_GPU_SCENARIOS:-}" ]; then bench bench2 next || rc=$?; fi
    engine_logs bench
    exit $rc
    ;;
  more)
    [ -f "$SITE/vllm/__init__.py" ] || die "vLLM is not installed on this machine (it went back since the bench stage): start again with piece0"
    [ -f "$STATE/state.json" ] || die "no benchmark state in $STATE: run the bench stage first"
    ensure_rota_imports
    bench more "${ROTA_GPU_SCENARIOS:-next}"
    rc=$?
    engine_logs more
    exit $rc
    ;;
  policy)
    environment
    copy_piece wheels.tar.xz.part-01
    install_bundle
    ensure_rota_imports
    budget=$(( $(left) - 25 ))
    say "policy comparison through the lease controller, $budget s"
    # shellcheck disable=SC2086
    timeout -k 15 $(( budget + 10 )) env PYTHONPATH="$(rota_path)" ROTA_VLLM_PYTHONPATH="$SITE" \
      "$PY" -m e2e.gpu.policy_run --launcher vllm --out "$OUT" --state-dir "$STATE" \
      --models "$INPUT/models" --budget-s "$budget" --vllm-python "$(command -v "$PY")" \
      ${ROTA_POLICY_ARGS:-}
    rc=$?
    say "policy comparison exited with status $rc"
    engine_logs policy
    exit $rc
    ;;
  keep)
    environment
    copy_piece wheels.tar.xz.part-01
    install_bundle
    ensure_rota_imports
    budget=$(( $(left) - 25 ))
    [ "$budget" -gt 60 ] || die "only $(left) s left: not enough for the keep probe"
    say "requests kept across sleeps on one engine, $budget s"
    # Its own state folder: the bench's state.json (engines other stages attach to) stays.
    # shellcheck disable=SC2086
    timeout -k 15 $(( budget + 10 )) env PYTHONPATH="$(rota_path)" ROTA_VLLM_PYTHONPATH="$SITE" \
      "$PY" -m e2e.gpu.keep_probe --launcher vllm --out "$OUT/keep.json" \
      --state-dir "$STATE/keep" --models "$INPUT/models" --budget-s "$budget" \
      --vllm-python "$(command -v "$PY")" ${ROTA_KEEP_ARGS:-}
    rc=$?
    say "keep probe exited with status $rc"
    engine_logs keep "$STATE/keep"
    exit $rc
    ;;
  stop)
    PYTHONPATH="$(rota_path)" "$PY" -m e2e.gpu.engines stop "$STATE"
    if [ -f "$STATE/keep/state.json" ]; then  # the keep probe's engine, if it was cut off
      PYTHONPATH="$(rota_path)" "$PY" -m e2e.gpu.engines stop "$STATE/keep"
    fi
    ;;
  status)
    environment
    PYTHONPATH="$(rota_path)" "$PY" -m e2e.gpu.engines status "$STATE"
    ;;
  *) die "unknown stage $STAGE (piece0, bench, more, policy, keep, stop, status)" ;;
esac
