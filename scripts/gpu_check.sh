#!/usr/bin/env bash
# The GPU check: a few minutes on one CUDA GPU, every figure written as JSON under $OUT (else ./gpu_check).
#   bash scripts/gpu_check.sh          # on a machine with a CUDA GPU; fails fast without one
#   bash scripts/gpu_check.sh --cpu    # dry run of every stage on the CPU, small: checks all but CUDA itself
# The machine may start bare: the check builds its own tiny base. Python: $LOPD_PYTHON, else .venv/bin/python,
# else python3 (it needs torch with CUDA and the pipeline's packages; no network is used).
# Stages, each under its own time limit; a failed stage is recorded and the next one still runs:
#   preflight            python, torch, CUDA, the packages the pipeline imports   preflight.json (stops here if not)
#   base                 `lopd base` with small settings                          base/, base.log
#   checks               scripts/gpu_check.py: CUDA and bf16 rollout, one LOPD     checks.json
#                        step in full, LoRA and bf16 LoRA mode, peak CUDA memory
#   rollout_float32      benchmarks/rollout_throughput.py on the device            rollout_float32.json
#   rollout_bfloat16     the same with a bf16 model                                rollout_bfloat16.json
#   step_cost            benchmarks/step_cost.py on the device                     step_cost.json
#   fsdp2                benchmarks/sharded_update.py under torchrun, one process   fsdp2.json
#                        per GPU (one GPU: one process, a one-rank FSDP2 group):
#                        sharded vs replicated updates, bytes per rank, CUDA peak
#   fsdp2_lora_bf16      the same in LoRA mode on a bf16 base                      fsdp2_lora_bf16.json
#   vllm_served          only where `import vllm` works (else skipped, said so):   vllm_served.txt
#                        `vllm serve` on the base, then `lopd bank`, `lopd coldstart`,
#                        `lopd distill` with rollout.backend=openai on that server.
#                        Untested: no machine with vLLM was at hand when it was written
#   pytest_gpu           the tests marked gpu                                      pytest_gpu.txt
# summary.json lists each stage's exit status and seconds; the script exits non-zero when any stage failed.
set -uo pipefail
cd "$(dirname "$0")/.."
mode=cuda
[ "${1:-}" = "--cpu" ] && mode=cpu
out="${OUT:-./gpu_check}"
mkdir -p "$out"
py="${LOPD_PYTHON:-}"
if [ -z "$py" ]; then
  if [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
fi
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

"$py" - "$mode" > "$out/preflight.json" <<'PY'
import importlib.util, json, sys
mode = sys.argv[1]
need = ["torch", "transformers", "peft", "tokenizers", "yaml", "lopd_core", "flows"]
info = {"python": sys.executable, "mode": mode, "missing": [m for m in need if importlib.util.find_spec(m) is None],
        "pytest": importlib.util.find_spec("pytest") is not None}
try:
    import torch
    info.update(torch=torch.__version__, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
except Exception as exc:  # a broken torch install is reported, not raised
    info["torch_error"] = f"{type(exc).__name__}: {exc}"
info["ok"] = not info["missing"] and "torch_error" not in info and (mode == "cpu" or info.get("cuda_available"))
print(json.dumps(info, indent=2))
sys.exit(0 if info["ok"] else 3)
PY
if [ $? -ne 0 ]; then
  echo "gpu_check: preflight failed ($py): $(tr -d '\n' < "$out/preflight.json")" >&2
  [ "$mode" = cuda ] && echo "gpu_check: no usable CUDA device here; run with --cpu for a dry run" >&2
  exit 3
fi

summary=()
stage() {  # stage NAME LIMIT_S STDOUT_FILE COMMAND...
  local name=$1 limit=$2 dest=$3 t0 rc
  shift 3
  t0=$(date +%s)
  echo "gpu_check: $name (at most ${limit}s) ..." >&2
  timeout "$limit" "$@" > "$out/$dest" 2> "$out/$name.log"
  rc=$?
  summary+=("{\"stage\": \"$name\", \"exit\": $rc, \"seconds\": $(( $(date +%s) - t0 )), \"output\": \"$dest\"}")
  echo "gpu_check: $name exit $rc" >&2
}

if [ "$mode" = cpu ]; then
  base_set=(--set model.warmstart.time_budget_s=10 --set model.warmstart.demos=300 --set model.warmstart.drills=300)
  device=cpu; tasks=2; groups=2; reps=1; check_args=(--cpu)
  step_args=(--tasks 2 --samples 2 --reps 1 --memory-reps 1)
else
  base_set=(--set model.warmstart.time_budget_s=45 --set model.warmstart.demos=2000 --set model.warmstart.drills=2000)
  device=cuda; tasks=8; groups=4,8; reps=3; check_args=()
  step_args=(--tasks 8 --samples 4 --reps 3)
fi
base="$out/base"
stage base 180 base.txt "$py" -m lopd_cli base --out "$base" --set model.warmstart.max_steps=0 "${base_set[@]}"
stage checks 300 checks.txt "$py" scripts/gpu_check.py --model "$base" --out "$out" "${check_args[@]}"
stage rollout_float32 240 rollout_float32.json "$py" benchmarks/rollout_throughput.py --model "$base" \
  --device "$device" --dtype float32 --tasks "$tasks" --groups "$groups" --repeats "$reps"
stage rollout_bfloat16 240 rollout_bfloat16.json "$py" benchmarks/rollout_throughput.py --model "$base" \
  --device "$device" --dtype bfloat16 --tasks "$tasks" --groups "$groups" --repeats "$reps"
stage step_cost 300 step_cost.json "$py" benchmarks/step_cost.py --model "$base" --device "$device" "${step_args[@]}"
# FSDP2: one process per GPU (the CPU dry run: 2 processes on gloo, small)
if [ "$mode" = cpu ]; then
  fsdp_procs=2; fsdp_args=(--device cpu --hidden 64 --layers 2 --updates 2)
else
  fsdp_procs=$("$py" -c "import torch; print(max(torch.cuda.device_count(), 1))")
  fsdp_args=(--device cuda --hidden 1024 --layers 8 --updates 3)
fi
stage fsdp2 300 fsdp2.json "$py" -m torch.distributed.run --nproc_per_node "$fsdp_procs" --master_addr 127.0.0.1 \
  --master_port 29531 benchmarks/sharded_update.py "${fsdp_args[@]}"
stage fsdp2_lora_bf16 300 fsdp2_lora_bf16.json "$py" -m torch.distributed.run --nproc_per_node "$fsdp_procs" \
  --master_addr 127.0.0.1 --master_port 29532 benchmarks/sharded_update.py "${fsdp_args[@]}" --mode lora \
  --dtype bfloat16

# Rollouts on a vLLM server (rollout.backend=openai). Needs vllm in $py's environment and the base on a path
# vLLM can load; the server's weights stay the base's (rollout.sync=none), enough to check the protocol end to end.
vllm_served() {  # run by `bash -c` under the stage's timeout: the server goes with it (trap)
  local work="$out/vllm_work" port=8011 pid rc
  mkdir -p "$work"
  "$py" -m vllm.entrypoints.openai.api_server --model "$base" --port "$port" --dtype float32 \
    --max-model-len 2048 --gpu-memory-utilization 0.3 > "$out/vllm_server.log" 2>&1 &
  pid=$!
  trap 'kill "$pid" 2> /dev/null' EXIT
  for _ in $(seq 1 150); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null 2>&1 && break
    kill -0 "$pid" 2> /dev/null || { echo "vllm serve exited; see vllm_server.log"; return 1; }
    sleep 2
  done
  local sets=(--set "model.name_or_path=$base" --set rollout.max_new_tokens=24 --set rollout.max_context=1024
              --set bank.seed_tasks=2
              --set coldstart.steps=2 --set lopd.steps=2 --set lopd.tasks_per_step=2 --set lopd.samples_per_task=2
              --set rollout.backend=openai --set "rollout.servers=[http://127.0.0.1:$port/v1]"
              --set rollout.sync=none)
  (cd "$work" && "$py" -m lopd_cli bank "${sets[@]}" && "$py" -m lopd_cli coldstart "${sets[@]}" \
     && "$py" -m lopd_cli distill --fresh "${sets[@]}")
  rc=$?
  kill "$pid" 2> /dev/null
  wait "$pid" 2> /dev/null
  return $rc
}
if "$py" -c "import vllm" > /dev/null 2>&1; then
  export -f vllm_served
  export out base py
  stage vllm_served 900 vllm_served.txt bash -c vllm_served
else
  echo "gpu_check: vllm_served skipped: vllm does not import in $py (pip install vllm to run it)" >&2
  summary+=("{\"stage\": \"vllm_served\", \"exit\": 0, \"seconds\": 0, \"output\": \"skipped: vllm not installed\"}")
fi

gpu_tests=$(grep -rl --include='test_*.py' 'mark.gpu' tests | sort)  # only these: the rest may need other packages
if grep -q '"pytest": true' "$out/preflight.json" && [ -n "$gpu_tests" ]; then
  # shellcheck disable=SC2086  # one path per word
  stage pytest_gpu 180 pytest_gpu.txt "$py" -m pytest -q -p no:cacheprovider -m gpu $gpu_tests
fi

failed=0
for s in "${summary[@]}"; do
  case "$s" in *'"exit": 0,'*) ;; *) failed=1 ;; esac
done
{
  printf '{"mode": "%s", "ok": %s, "stages": [\n' "$mode" "$([ $failed = 0 ] && echo true || echo false)"
  for i in "${!summary[@]}"; do
    printf '  %s%s\n' "${summary[$i]}" "$([ "$i" -lt $(( ${#summary[@]} - 1 )) ] && echo ,)"
  done
  printf ']}\n'
} > "$out/summary.json"
cat "$out/summary.json"
exit $failed
