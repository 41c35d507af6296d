#!/usr/bin/env bash
# Every GPU measurement of docs/performance.md in one call of the device tool (one H200), most important first.
# Each row is its own process (clean peak-memory counter, its own XLA_FLAGS); a row that would pass the budget is
# skipped, and the table of whatever ran is printed last. Full rows: $OUT/results.jsonl, logs: $OUT/log.txt.
#
# Before the call, here: .whl/ holds the wheels the device lacks (grain, array-record, portpicker,
# ml_collections) and .ref/ the reference DiT's models.py
# (docs/performance.md says how); both folders are git-ignored and never committed. Then:
#   run(command="bash scripts/device_bench.sh core", carry=[".whl", ".ref"], timeout_s=330)
#   run(command="bash scripts/device_bench.sh extra", carry=[".whl", ".ref"], timeout_s=330)
# core:  XL/2 TREAD off; torch DiT-XL/2; XL/2 TREAD on; B/2 off+on (+ckpt); torch DiT-B/2; attention check.
# extra: PRX-1B off+on; XL/2 with q,k,v as three GEMMs (before this work); XL/2 with XLA attention; XL/2 with each
#        XLA flag tried; XL/2 checkpoint blocking, plain and staged; XL/2 again (a compilation-cache hit); XL/2 with
#        scan over blocks.
# speedup: the GPU speedup size's sweep (docs/speedup.md, "gpu"), carried on over as many calls as it takes:
#   run(command="BUDGET_S=540 bash scripts/device_bench.sh speedup", carry=[".whl"], timeout_s=580)
#   finished runs come back in $OUT/records.tar: untar it into docs/results/gpu/ and commit before the next call (an
#   autoencoder_*.partial.npz beside it, a training the cap cut, is git-ignored: put it in docs/results/gpu/ too and
#   name it in the next call's carry).
# ROWS="1 3" runs only those rows of the phase (numbered from 1 in the order below): the rest of a cut-short call.
# SMOKE=1 runs the same sequence with the tiny preset on this machine's CPU (checks the script, not the GPU).
set -u
phase=${1:-core}
OUT=${OUT:-/tmp/reve_device_bench}
mkdir -p "$OUT"
budget=${BUDGET_S:-300}
deadline=$((SECONDS + budget))
log=$OUT/log.txt
res=$OUT/results.jsonl

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 && [ -z "${SMOKE:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 PYTHONUNBUFFERED=1
base_flags=${XLA_FLAGS:-}

if [ -n "${SMOKE:-}" ]; then
  XL=tiny B=tiny PRX=tiny batch=16 state_gb=0.05
  common=(--steps 2 --repeats 1 --warmup 1 --data-steps 2 --config.train.compile_cache=/tmp/reve_smoke_cache)
else
  XL=dit-xl2 B=dit-b2 PRX=prx-1b batch=256 state_gb=10.8
  common=(--steps 5 --repeats 3 --warmup 2 --data-steps 5 --config.train.compile_cache=/tmp/reve_jax_cache)
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,memory.used --format=csv >"$OUT/gpu.txt" 2>&1
fi

# host SECONDS_CAP ARGS...: one scripts/bench_host.py process (its rows go to the log and host.jsonl).
host() {
  local cap=$1
  shift
  local left=$((deadline - SECONDS - 15))
  if [ "$left" -lt 30 ]; then
    echo "[skip, budget] host $*" | tee -a "$log"
    return
  fi
  [ "$left" -lt "$cap" ] && cap=$left
  timeout "$cap" python3 scripts/bench_host.py "$@" --out "$OUT" 2>>"$log" | tee -a "$log"
}

# bench SECONDS_CAP LABEL ARGS...: one benchmark process, cut at the cap or the deadline.
row=0
bench() {
  local cap=$1 label=$2
  shift 2
  row=$((row + 1))
  if [ -n "${ROWS:-}" ] && [[ " $ROWS " != *" $row "* ]]; then
    return
  fi
  local left=$((deadline - SECONDS - 15))
  if [ "$left" -lt 40 ]; then
    echo "[skip, budget] $label" | tee -a "$log"
    return
  fi
  [ "$left" -lt "$cap" ] && cap=$left
  echo "=== $label (cap ${cap}s, at ${SECONDS}s) XLA_FLAGS='${XLA_FLAGS:-}'" | tee -a "$log"
  # SIGABRT at the cap: Python's fault handler then prints every thread's stack, so a hang says where it was.
  PYTHONFAULTHANDLER=1 timeout -s ABRT -k 10 "$cap" python3 scripts/bench_throughput.py "${common[@]}" \
    --out "$OUT" --label "$label" --peer-timeout $((cap - 10)) "$@" >>"$log" 2>&1
  local rc=$?
  if [ $rc -ne 0 ]; then
    echo "[failed rc=$rc$([ $rc = 124 ] && echo ", cut at ${cap}s: stacks in log.txt")] $label" | tee -a "$log"
  else
    grep -E "^\| " "$log" | tail -n 1
  fi
}

case $phase in
core)
  bench 150 "" --preset "$XL" --batch "$batch" --tread off --ckpt off
  bench 160 "" --preset "$XL" --batch "$batch" --ours off --peer --ckpt off --data-steps 0
  bench 120 "" --preset "$XL" --batch "$batch" --tread on --ckpt off
  bench 120 "" --preset "$B" --batch "$batch" --tread both --ckpt on
  bench 100 "" --preset "$B" --batch "$batch" --ours off --peer --ckpt off --data-steps 0
  # cuDNN against XLA attention on small inputs, alone (no model): last, so a hang there costs no row.
  bench 45 "" --preset "$B" --ours off --check-attention --data-steps 0
  ;;
extra)
  bench 120 "" --preset "$PRX" --batch "$((batch / 2))" --tread both --ckpt off
  # Before this work: q, k, v and gate, up as separate GEMMs, in a copy of the tree whose layers.py has the two
  # stacked projections swapped back (nothing else differs).
  rm -rf /tmp/reve_unfused && mkdir -p /tmp/reve_unfused
  tar --exclude=.whl --exclude=.git -cf - . | tar -C /tmp/reve_unfused -xf -
  if python3 - /tmp/reve_unfused/reve_jax/model/layers.py <<'PY'; then
import sys
path = sys.argv[1]
text = open(path).read()
swaps = {
    """        qkv = stacked_projection(x, (self.q, self.k, self.v))  # [B, S, 3, W]
        qkv = checkpoint_name(qkv.reshape(b, s, 3, self.heads, self.head_dim), "attn_qkv")
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
""": """        shape = (b, s, self.heads, self.head_dim)
        q, k, v = self.q(x).reshape(shape), self.k(x).reshape(shape), self.v(x).reshape(shape)
""",
    """        gate_up = checkpoint_name(stacked_projection(x, (self.gate, self.up)), "mlp_gate_up")  # [..., 2, hidden]
        return self.down(jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :])
""": """        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))
""",
}
for old, new in swaps.items():
    if old not in text:
        sys.exit("layers.py changed: update the unfused swap in scripts/device_bench.sh")
    text = text.replace(old, new)
open(path, "w").write(text)
PY
    (cd /tmp/reve_unfused && PYTHONPATH=/tmp/site:$PWD bench 100 "3 GEMMs" --preset "$XL" --batch "$batch" --ckpt off)
  fi
  bench 100 "attn xla" --preset "$XL" --batch "$batch" --ckpt off --config.model.attention=xla
  XLA_FLAGS="$base_flags --xla_gpu_enable_latency_hiding_scheduler=true" \
    bench 100 "LHS" --preset "$XL" --batch "$batch" --ckpt off --data-steps 0
  XLA_FLAGS="$base_flags --xla_gpu_enable_command_buffer=" \
    bench 100 "no cmd buf" --preset "$XL" --batch "$batch" --ckpt off --data-steps 0
  bench 120 "ckpt" --preset "$XL" --batch "$batch" --ckpt on --data-steps 0
  # The save staged behind the next step (train.ckpt_overlap): the loop should block for a device copy only.
  bench 60 "ckpt staged" --preset "$XL" --batch "$batch" --ckpt staged --data-steps 0
  # The same program as the row above: its compile time is a persistent-cache hit.
  bench 60 "cache hit" --preset "$XL" --batch "$batch" --ckpt off --data-steps 0
  # Scan over the blocks: compile time against the first row's, and the step cost of stacking the weights.
  bench 100 "scan" --preset "$XL" --batch "$batch" --ckpt off --data-steps 0 --config.model.scan_layers=True
  # Host side without the model: an XL/2-sized state's save (plain, staged) and the input rate with threads and
  # with worker processes on this host's cores.
  host 60 ckpt --gb "$state_gb" --leaves 560
  host 60 input --preset "$B" --batch "$batch" --config.data.worker_threads=8
  host 60 input --preset "$B" --batch "$batch" --config.data.worker_threads=1 --config.data.worker_processes=8
  ;;
speedup)
  # The sweep keeps every finished run in its archive, docs/results/gpu/ (carried with the tree): a run found there is
  # reused, not rerun, and the autoencoder trained by the first call is shared through it too. A run that the budget
  # cuts is lost with the machine (its checkpoint is not sent back). SMOKE: the code path, shrunk, in /tmp only.
  archive=docs/results/gpu quick=()
  [ -n "${SMOKE:-}" ] && archive=/tmp/reve_smoke_archive quick=(--quick)
  mkdir -p "$archive"
  left=$((deadline - SECONDS - 20))
  if [ "$left" -lt 120 ]; then
    echo "[skip, budget] speedup sweep" | tee -a "$log"
  else
    echo "=== speedup sweep (cap ${left}s, at ${SECONDS}s): $(ls "$archive" | grep -c json) runs in the archive" | tee -a "$log"
    # TERM at the cap: the benchmark stops at its next step, as it does when a session ends.
    timeout -s TERM -k 30 "$left" python3 scripts/bench_speedup.py --size gpu "${quick[@]}" --out /tmp/reve_sweep_gpu \
      --cache-dir /tmp/reve_gpu_cache --sweep --methods latent,recipe --archive "$archive" >>"$log" 2>&1
    echo "[speedup sweep rc=$?]" | tee -a "$log"
  fi
  # The device tool sends back 8 files at most: the records in one tar (JSON and the finished autoencoder, ~5 MB).
  rm -rf /tmp/reve_records && mkdir -p /tmp/reve_records
  cp "$archive"/*.json "$archive"/autoencoder_*[0-9a-f].npz /tmp/reve_records/ 2>/dev/null
  tar -C /tmp/reve_records -cf "$OUT/records.tar" .
  # An autoencoder whose training the cap cut: its state, to be carried into the next call's archive.
  for partial in /tmp/reve_gpu_cache/autoencoder_*.partial.npz; do
    [ -e "$partial" ] && [ ! -e "${partial%.partial.npz}.npz" ] && cp "$partial" "$OUT/"
  done
  grep -E "^(freeze in|sweep |autoencoder |\[.*\] step )" "$log" | tail -n 20
  echo "records: $(ls /tmp/reve_records | grep -c json) runs in $OUT/records.tar (untar into docs/results/gpu/)"
  exit 0
  ;;
*)
  echo "usage: $0 core|extra|speedup" >&2
  exit 2
  ;;
esac

grep -E "attention check|cuDNN|cudnn" "$log" | cut -c1-400 | tail -n 4
python3 scripts/bench_throughput.py --table-from "$OUT"
