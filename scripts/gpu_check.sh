#!/usr/bin/env bash
# GPU check of the Triton kernels, in one command, for a machine with one CUDA GPU:
#
#   OUT=/some/dir scripts/gpu_check.sh          (OUT defaults to ./gpu_check_out)
#
#   0. preflight (~10 s): CUDA visible, a C compiler (Triton builds its launcher with it), Triton's ptxas,
#      `import gear_hf.cache`, one trivial Triton kernel launched and checked; stops early with a clear message;
#   1. the compile report (`python -m gear_hf.kernels.compile_check --sass-report`) with this machine's Triton;
#   2. the `gpu` tests (tests/test_kernels_gpu.py): bit-exact quantize/pack at real sizes, fused decode
#      attention vs the float32 oracle at T up to 32k with Llama-3-8B head shapes in bf16, poisoned output,
#      two GPUs (skipped with one), end-to-end generate through the fused path;
#   3. the decode-attention benchmark (scripts/bench_decode_attention.py), eager and CUDA-graph timings:
#      fused GEAR 2/4-bit, GEAR-L 2-bit, GearConfig() (kivi: keys 3.125 bits per channel on average, widths
#      allocated from the queries as bit planes; 3-bit values per token, rotated; config.py RECOMMENDED "accurate")
#      and recommended "compact" (keys 2.5 bits allocated, 2-bit values per channel, ranges searched) vs fp16 SDPA at T = 8k/1k, batch 8 and 1; a padded batch of 8 rows
#      of 8 lengths vs masked fp16 SDPA; num_warps 4/8 x num_stages 1/2/3; and the share of decode layer-steps
#      on the fused path in greedy generation of a padded batch of 8 rows -> $OUT/bench_decode_attention.*;
#   4. with the time left, the CPU-interpreted kernel suites compiled for the GPU (extra coverage).
#
# Every stage has its own timeout, derived from a global budget (GPU_CHECK_BUDGET seconds, default 340, i.e.
# under 6 minutes), so the script ends in time and what was measured is kept. Exit status: 0 when the gpu tests
# passed and the benchmark wrote its table, 1 otherwise (2: preflight failed). A summary is printed last and
# kept in $OUT/summary.txt.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD
OUT=${OUT:-$REPO/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
BUDGET=${GPU_CHECK_BUDGET:-340}
START=$SECONDS
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
left() { echo $(( BUDGET - (SECONDS - START) )); }
summary=()
note() { echo ">> $*"; summary+=("$*"); }

# -- environment ------------------------------------------------------------------------------------------
"$PY" - > "$OUT/env.json" 2> "$OUT/env.err" <<'EOF'
import json, platform
info = {"python": platform.python_version()}
try:
    import torch
    info.update(torch=torch.__version__, cuda=torch.version.cuda, available=torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, sms=p.multi_processor_count, memory_gb=round(p.total_memory / 2**30, 1))
except Exception as e:
    info["torch_error"] = repr(e)
for mod in ("triton", "transformers", "pytest"):
    try:
        info[mod] = __import__(mod).__version__
    except Exception as e:
        info[mod] = None
print(json.dumps(info, indent=1))
EOF
cat "$OUT/env.json"
# -- 0. preflight: stop early, and say why, when the machine cannot run the kernels at all -----------------
fail_early() { note "PREFLIGHT FAILED: $*"; printf '%s\n' "${summary[@]}" > "$OUT/summary.txt"; exit 2; }
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  fail_early "no CUDA device visible to $PY"
fi
command -v "${CC:-cc}" >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || command -v clang >/dev/null 2>&1 \
  || fail_early "no C compiler (cc/gcc/clang): Triton cannot build its kernel launcher"
# triton.jit needs its function in a real file (inspect.getsource): the preflight is written to one
PREFLIGHT_PY=$(mktemp --suffix=_gear_preflight.py)
cat > "$PREFLIGHT_PY" <<'EOF'
import time
t0 = time.time()
import torch, triton, triton.language as tl
from pathlib import Path
ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
assert ptxas.exists() or __import__("shutil").which("ptxas"), f"no ptxas (looked at {ptxas} and PATH)"
import gear_hf.cache, gear_hf.kernels.decode  # noqa: F401  (the package and the kernel module import)

@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)

x = torch.arange(1000, device="cuda", dtype=torch.float32)
_add_one[(4,)](x, 1000, BLOCK=256)
torch.cuda.synchronize()
assert torch.equal(x.cpu(), torch.arange(1, 1001, dtype=torch.float32)), "trivial Triton kernel computed garbage"
print(f"preflight ok in {time.time() - t0:.1f}s: torch {torch.__version__}, triton {triton.__version__}, "
      f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")
EOF
timeout -k 5 60 "$PY" "$PREFLIGHT_PY" > "$OUT/preflight.log" 2>&1
rc=$?
tail -n 5 "$OUT/preflight.log"
[ $rc = 0 ] || fail_early "rc=$rc, see preflight.log: $(tail -n 1 "$OUT/preflight.log")"
note "$(tail -n 1 "$OUT/preflight.log")"

# -- 1. compile report (static: SASS of the main loop with this machine's Triton) ----------------------------
timeout -k 5 90 "$PY" -m gear_hf.kernels.compile_check --sass-report > "$OUT/sass_report.log" 2>&1
rc=$?
note "compile report (rc=$rc): $(grep -E '^((gear[234]|default): main loop|instructions/token)' "$OUT/sass_report.log" | tr '\n' ' ')"

# gear_hf.patches (used only by the end-to-end test) needs the setup.cfg package mapping: an offline editable
# install provides it; without it that one test skips.
timeout 60 "$PY" -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip.log" 2>&1 \
  || note "editable install failed (see pip.log): the end-to-end gpu test will skip"
HAVE_PYTEST=1
"$PY" -c "import pytest" 2>/dev/null || { HAVE_PYTEST=0; note "pytest missing: test stages skipped"; }

status=0
# -- 2. gpu tests ---------------------------------------------------------------------------------------------
if [ "$HAVE_PYTEST" = 1 ]; then
  t=$(( $(left) * 40 / 100 ))
  echo ">> gpu tests (timeout ${t}s)"
  timeout -k 10 "$t" "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels_gpu.py -rA \
    --junitxml="$OUT/gpu_tests.xml" > "$OUT/gpu_tests.log" 2>&1
  rc=$?
  tail -n 25 "$OUT/gpu_tests.log"
  if [ $rc = 0 ]; then note "gpu tests: passed ($(tail -n 1 "$OUT/gpu_tests.log"))"
  else note "gpu tests: rc=$rc ($(tail -n 1 "$OUT/gpu_tests.log"))"; status=1; fi
fi

# -- 3. benchmark ---------------------------------------------------------------------------------------------
t=$(( $(left) - 45 ))
[ "$t" -lt 60 ] && t=60
echo ">> benchmark (timeout ${t}s)"
timeout -k 10 "$t" "$PY" scripts/bench_decode_attention.py --out "$OUT" --T 8192 1024 --batch 8 1 --iters 20 \
  --no-reference --share --padded --variants > "$OUT/bench.log" 2>&1
rc=$?
cat "$OUT/bench.log" | tail -n 40
share=$(grep -m1 '^fused-path share' "$OUT/bench.log")
[ -n "$share" ] && note "$share"
if [ -s "$OUT/bench_decode_attention.csv" ]; then
  note "benchmark: rc=$rc, $(($(wc -l < "$OUT/bench_decode_attention.csv") - 1)) rows in bench_decode_attention.csv"
  [ $rc = 0 ] || note "benchmark ended early (timeout or error): the table holds what was measured"
else
  note "benchmark: rc=$rc, no table"; status=1
fi

# -- 4. the interpreted suites, compiled for the GPU, with the time left --------------------------------------
t=$(( $(left) - 5 ))
if [ "$HAVE_PYTEST" = 1 ] && [ "$t" -ge 30 ]; then
  echo ">> kernel suites on the GPU (timeout ${t}s)"
  timeout -k 5 "$t" "$PY" -m pytest -q -p no:cacheprovider -m "not slow" tests/test_kernels_quant.py \
    tests/test_architectures.py::test_fused_kernel_matches_reference tests/test_kernels_decode.py \
    > "$OUT/kernel_suites.log" 2>&1
  rc=$?
  note "kernel suites compiled on the GPU: rc=$rc ($(tail -n 1 "$OUT/kernel_suites.log"))"
fi

note "total $((SECONDS - START))s"
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
exit $status
