#!/bin/bash
# ABAB: baseline 72c6e77 and main, each tree's own bench_decode.py, same args, one after the other
set -e
export GEAR_HF_DATA_DIR=/work/shared/data
M="dynamic,fp16,kivi-2,gear-2,rec-accurate"
for i in 1 2; do
  (cd /tmp/baseline && PYTHONPATH=/tmp/baseline OMP_NUM_THREADS=2 /work/main/.venv/bin/python scripts/bench_decode.py --quick --methods $M --repeats 2 --out /tmp/speed/base$i > /tmp/speed/base$i.log 2>&1)
  (cd /work/main && OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_decode.py --quick --methods $M --repeats 2 --out /tmp/speed/main$i > /tmp/speed/main$i.log 2>&1)
done
echo done
