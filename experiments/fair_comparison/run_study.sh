#!/usr/bin/env bash
# The pre-registered study's runs, in their order (docs/batch_sweep.md): the plateau
# pilot of each regime, then each regime's comparison at the plateau budget (the cells
# that decide first: B = 2048 and 4096; then B = 512), then the wall-clock-matched
# budget. Every step resumes from its record or ledger: run this again after a stop and
# it goes on where it was. From a checkout holding data/glyphs and data/pretrained:
#
#   nohup nice -n 19 experiments/fair_comparison/run_study.sh > logs/study.log 2>&1 &
#
# REGIMES picks the regimes (default: both, one after the other). On 2 cores, one
# process per regime, each pinned to a core, gets through more runs than one
# process on both (a Smooth-AP update at B = 4096 takes 0.71 s on 2 cores, 1.17 s on
# one, and the sampler and scoring between updates use one core):
#
#   REGIMES=strong nohup nice -n 19 taskset -c 0 experiments/fair_comparison/run_study.sh \
#       > logs/study_strong.log 2>&1 &
#   REGIMES=weak nohup nice -n 19 taskset -c 1 experiments/fair_comparison/run_study.sh \
#       > logs/study_weak.log 2>&1 &
set -euo pipefail
PY=${PYTHON:-python}
R=experiments/fair_comparison/results
# The size rule's cuts (docs/batch_sweep.md, amendments 1 and 4): Smooth-AP and the
# histogram loss against triplet and SupCon; repeats on validation folds over one grid.
LOSSES=SmoothAP,FastAP,Triplet,SupCon
SECONDS_PER_RUN=120
# The pilot's learning rates (amendment 6): the defaults' 1e-3 and the grid's two largest,
# so the plateau is that of runs whose rate was picked.
PILOT_LRS=0.001,0.007535659294528742,0.03
REGIMES=${REGIMES:-strong weak}
config() {
  if [ "$1" = weak ]; then echo experiments/fair_comparison/glyphs_pretrained_weak.yaml
  else echo experiments/fair_comparison/glyphs_pretrained.yaml; fi
}
compare() {  # regime, then compare's own arguments
  local regime=$1; shift
  $PY -m tfaploss.cli compare --config "$(config "$regime")" --features \
    --val data/glyphs/val --test-classes 500 --losses $LOSSES --tuning-repeats 3 \
    --repeat-by folds --grid 6 --grid-knob-points 4 \
    --seeds 0,1,2,3,4 --out $R/study_"$regime" "$@"
}
for regime in $REGIMES; do
  $PY experiments/fair_comparison/plateau_pilot.py --config "$(config $regime)" \
    --val data/glyphs/val --cache $R/study_$regime --losses $LOSSES --batch 4096 \
    --start 65536 --largest 2097152 --lrs $PILOT_LRS --out $R/plateau_$regime.json
done
plateau() {
  $PY -c "import json, sys; print(json.load(open(sys.argv[1]))['plateau_images'] or '')" \
    $R/plateau_"$1".json
}
for regime in $REGIMES; do
  if [ -z "$(plateau $regime)" ]; then
    echo "the $regime pilot found no plateau up to its largest budget: stopping" >&2
    exit 1
  fi
done
# The deciding cells first; each later call reuses the ledger's runs and adds its own,
# and the last one writes each regime's whole report (both budgets, every batch).
for regime in $REGIMES; do
  compare $regime --batch-sizes 2048,4096 --images "$(plateau $regime)"
done
for regime in $REGIMES; do
  compare $regime --batch-sizes 512,2048,4096 --images "$(plateau $regime)"
done
for regime in $REGIMES; do
  compare $regime --batch-sizes 512,2048,4096 --budgets images,seconds \
    --images "$(plateau $regime)" --seconds $SECONDS_PER_RUN
done
# The pre-registered rule on what has run (prints "undecided" while cells are missing).
$PY experiments/fair_comparison/decide.py \
  strong=$R/study_strong/results.json weak=$R/study_weak/results.json
