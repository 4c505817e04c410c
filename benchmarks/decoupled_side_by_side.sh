#!/usr/bin/env bash
# Runs the four variants of benchmarks/decoupled_bench.py at the same time, one invocation each, and
# merges their results into one file. Needs a machine with at least ~12 free cores (3 gloo workers
# + 3 × 3 learners, one torch thread each, plus their mostly idle p2pd and helper processes); on
# fewer cores the variants would slow each other down and the figures would mean little.
#
#   PYTHON=.venv/bin/python bash benchmarks/decoupled_side_by_side.sh [results.json]
#
# Environment knobs: H (inner steps per outer step, default 150), N (outer steps; default: as many
# as fit TRAIN_SECONDS of training at the step time measured first), TRAIN_SECONDS (default 330),
# TAU (overlap steps, default H/P − 1 with P = 4), M (learners, default 3), EXTRA (more
# decoupled_bench.py arguments for every variant, e.g. "--set averaging.target_group_size=3").
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the project, also where it is not pip-installed
PY=${PYTHON:-python3}
OUT_JSON=${1:-benchmarks/results/decoupled_bench_side_by_side.json}
H=${H:-150}
M=${M:-3}
TAU=${TAU:-$((H / 4 - 1))}
TRAIN_SECONDS=${TRAIN_SECONDS:-330}
EXTRA=${EXTRA:-}
WORK=$(mktemp -d /tmp/decoupled-side-by-side-XXXX)

# One inner step of the benchmark's model, timed alone (20 steps after 5 warm-up steps).
STEP=$($PY - <<'EOF'
import time, torch
from benchmarks.decoupled_bench import parse_args, resolve
from p2p_diloco.train.data.batches import BatchSampler, load_split
from p2p_diloco.train.models.gpt import build_model
torch.set_num_threads(1)
cfg = resolve(parse_args([]))
model = build_model(cfg.model, 0)
opt = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr)
sampler = BatchSampler(load_split(cfg.data, 0), cfg.model.seq_len, cfg.inner.batch_size, seed=0)
for i in range(25):
    if i == 5:
        t0 = time.perf_counter()
    x, y = sampler.next_batch()
    _, loss = model(x, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"{(time.perf_counter() - t0) / 20:.4f}")
EOF
)
N=${N:-$($PY -c "print(max(3, min(24, int($TRAIN_SECONDS / ($H * $STEP * 1.15)))))")}
SLOW=$($PY -c "print(round(2 * $STEP, 3))")   # the slow learner's steps take about 3x as long
echo "step ${STEP}s alone -> M=$M H=$H N=$N tau=$TAU, slow learner sleeps ${SLOW}s per step; work in $WORK"

COMMON=(--learners "$M" --outer-steps "$N" --steps-per-outer "$H" --overlap-steps "$TAU" --variant-timeout 1200
        --workdir "$WORK" --slow-extra-seconds "$SLOW")
# shellcheck disable=SC2206
COMMON+=($EXTRA)
pids=()
for v in dp sync decoupled decoupled-mixed; do
  $PY benchmarks/decoupled_bench.py "${COMMON[@]}" --variants "$v" --json "$WORK/$v.json" >"$WORK/$v.out" 2>&1 &
  pids+=($!)
done
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
for v in dp sync decoupled decoupled-mixed; do echo "== $v"; tail -n 3 "$WORK/$v.out"; done
files=()
for v in dp sync decoupled decoupled-mixed; do [[ -f $WORK/$v.json ]] && files+=("$WORK/$v.json"); done
$PY benchmarks/decoupled_bench.py --from-json "${files[@]}" --json "$OUT_JSON"
echo "results in $OUT_JSON; logs in $WORK"
exit $status
