#!/usr/bin/env bash
# The online budget's host time per step at its serving cadences and longer ones (CPU, budget 64,
# bs 1 and 8, served rounds of 2.5 ms with jitter): one series per cadence,
# results/online-budget_cpu_host_time_p<predict_every>_t<time_every>.{json,md}.
#   bash lab/bench/budget_cadences.sh
set -euo pipefail
for cadence in "32 8" "32 16" "64 8" "64 16"; do
  set -- $cadence
  python -m lab.bench.online_budget_host --cpu --budgets 64 --batch-sizes 1 8 --round-us 2500 --jitter 0.2 \
    --predict-every "$1" --time-every "$2" --name "online-budget_cpu_host_time_p$1_t$2" > /dev/null
done
# The serving cadences with the host's caches evicted between steps, as a served round leaves them:
# results/online-budget_cpu_host_time_cold.{json,md}.
python -m lab.bench.online_budget_host --cpu --budgets 64 --batch-sizes 1 8 --round-us 2500 --jitter 0.2 \
  --cold --name online-budget_cpu_host_time_cold > /dev/null
# Under load, cold: the batch's size walking between half the batch size and all of it
# (results/online-budget_cpu_host_time_cold_wander.{json,md}).
python -m lab.bench.online_budget_host --cpu --budgets 64 --batch-sizes 8 32 64 --round-us 2500 --jitter 0.2 \
  --cold --churn 0.4 --wander --name online-budget_cpu_host_time_cold_wander > /dev/null
