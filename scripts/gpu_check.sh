#!/usr/bin/env bash
# GPU check of the Triton kernels and the end-to-end decode, in one command, for a machine with one CUDA GPU:
#
#   OUT=/some/dir scripts/gpu_check.sh          (OUT defaults to ./gpu_check_out)
#
# Stages, each under its own `timeout` (seconds, the budget of each below; 555 s in all, under 10 minutes with the
# start-up), so a slow stage cannot eat the next ones and what was measured is kept:
#
#   0. environment + preflight (60): CUDA visible, a C compiler, Triton's ptxas, `import gear_hf.cache`, one trivial
#      Triton kernel launched and checked (stops early, exit 2, with a clear message); editable install (30) so that
#      gear_hf.patches imports;
#   1. the compile report (75): `python scripts/dev/compile_check.py --sass-report` with this machine's Triton;
#   2. the tests on the GPU (125): `-m gpu tests/test_kernels_gpu.py`, and compiled for the GPU the reconstruction
#      kernel's suite (tests/test_kernels_reconstruct.py: the memory-bound fallback vs the oracle), the cost model and
#      the vLLM backend's paged kernel vs the oracle (tests/test_triton_paged.py);
#   3. decode attention (90): scripts/bench_decode_attention.py at T=8k, batch 8: fp16 SDPA, the fused kernel (GEAR
#      2/4-bit, GEAR-L, GearConfig(), compact) and the reference rows, which on CUDA are the fallback (the Triton
#      reconstruction, then RoPE and SDPA), eager and CUDA-graph timings; the fused-path share of a padded generate;
#   4. end-to-end decode (120): scripts/bench_gpu_generate.py, short: random-weight Llama-3-8B shapes, T=8k (GEN_T),
#      32 new tokens (GEN_NEW), dynamic / HF QuantizedCache (when quanto imports) / GearConfig() / kivi-2 / gear-2:
#      tokens/s, peak memory, decode paths, and throughput at equal KV memory (60 GiB, batch capped at 64);
#   5. serving attention (60): scripts/bench_paged_attention.py, the vLLM GPU backend's kernel over GEAR pages
#      (fp16 raw, GearConfig(), kivi-4, gear-2; block 16) against SDPA over the dense bf16 context, 32 requests x 4096
#      tokens, Llama-3-8B attention shapes: ms, bytes read, error vs the float32 oracle. The engine-level serving run
#      (vLLM with --attention-backend CUSTOM against kv_cache_dtype fp8 / int4_per_token_head) needs a CUDA build of
#      vLLM, which the device machines cannot install (no network) and cannot carry (over the 64 MiB a run takes):
#      the summary says whether one was found; it is not scripted.
#
# $OUT holds at most 8 files, one level: env.json, preflight.log, sass_report.log, tests.log, bench.log (every
# benchmark's log), bench_decode_attention.csv, bench_gpu_generate.json (with bench_paged_attention's rows under
# "paged_attention"), summary.txt. Exit status: 0 when the tests passed and both
# benchmarks wrote their tables, 1 otherwise (2: preflight failed). The summary is printed last.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$PWD
OUT=${OUT:-$REPO/gpu_check_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
START=$SECONDS
SCRATCH=$(mktemp -d)  # what the tools write beside their tables (copied into $OUT selectively)
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
summary=()
note() { echo ">> $*"; summary+=("$*"); }

# -- environment ------------------------------------------------------------------------------------------
"$PY" - > "$OUT/env.json" 2> "$OUT/preflight.log" <<'EOF'
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
timeout -k 5 60 "$PY" "$PREFLIGHT_PY" >> "$OUT/preflight.log" 2>&1
rc=$?
tail -n 5 "$OUT/preflight.log"
[ $rc = 0 ] || fail_early "rc=$rc, see preflight.log: $(tail -n 1 "$OUT/preflight.log")"
note "$(tail -n 1 "$OUT/preflight.log")"

# -- 1. compile report (static: SASS of the main loop with this machine's Triton) ----------------------------
timeout -k 5 75 "$PY" scripts/dev/compile_check.py --sass-report > "$OUT/sass_report.log" 2>&1
rc=$?
note "compile report (rc=$rc): $(grep -E '^((gear[234]|default): main loop|instructions/token)' "$OUT/sass_report.log" | tr '\n' ' ')"

# gear_hf.patches (used only by the end-to-end test) needs the setup.cfg package mapping: an offline editable
# install provides it; without it that one test skips.
timeout 30 "$PY" -m pip install -q --no-deps --no-build-isolation -e . >> "$OUT/preflight.log" 2>&1 \
  || note "editable install failed (see preflight.log): the end-to-end gpu test will skip"
HAVE_PYTEST=1
"$PY" -c "import pytest" 2>/dev/null || { HAVE_PYTEST=0; note "pytest missing: test stages skipped"; }

status=0
# -- 2. tests on the GPU ----------------------------------------------------------------------------------------
if [ "$HAVE_PYTEST" = 1 ]; then
  echo ">> gpu tests (timeout 125s)"
  timeout -k 10 125 "$PY" -m pytest -q -p no:cacheprovider -rfE tests/test_kernels_gpu.py \
    tests/test_kernels_reconstruct.py tests/test_decode_path_cost.py tests/test_triton_paged.py > "$OUT/tests.log" 2>&1
  rc=$?
  tail -n 25 "$OUT/tests.log"
  if [ $rc = 0 ]; then note "gpu tests: passed ($(tail -n 1 "$OUT/tests.log"))"
  else note "gpu tests: rc=$rc ($(tail -n 1 "$OUT/tests.log"))"; status=1; fi
fi

# -- 3. decode attention ------------------------------------------------------------------------------------------
echo ">> decode attention (timeout 90s)"
timeout -k 10 90 "$PY" scripts/bench_decode_attention.py --out "$SCRATCH/attention" --T 8192 --batch 8 --iters 20 \
  --share > "$OUT/bench.log" 2>&1
rc=$?
tail -n 30 "$OUT/bench.log"
share=$(grep -m1 '^fused-path share' "$OUT/bench.log")
[ -n "$share" ] && note "$share"
if [ -s "$SCRATCH/attention/bench_decode_attention.csv" ]; then
  cp "$SCRATCH/attention/bench_decode_attention.csv" "$OUT/"
  note "decode attention: rc=$rc, $(($(wc -l < "$OUT/bench_decode_attention.csv") - 1)) rows in bench_decode_attention.csv"
  [ $rc = 0 ] || note "decode attention ended early (timeout or error): the table holds what was measured"
else
  note "decode attention: rc=$rc, no table"; status=1
fi

# -- 4. end-to-end decode -----------------------------------------------------------------------------------------
echo ">> end-to-end decode (timeout 120s)"
echo "== bench_gpu_generate.py ==" >> "$OUT/bench.log"
timeout -k 10 120 "$PY" scripts/bench_gpu_generate.py --out "$SCRATCH/generate" --T ${GEN_T:-8192} \
  --new ${GEN_NEW:-32} --batch 1 --kv-budget-gib 60 --max-batch 64 >> "$OUT/bench.log" 2>&1
rc=$?
if [ -s "$SCRATCH/generate/bench_gpu_generate.json" ]; then
  cp "$SCRATCH/generate/bench_gpu_generate.json" "$OUT/"
  note "end-to-end decode: rc=$rc, $(grep -c '"method"' "$OUT/bench_gpu_generate.json") rows in bench_gpu_generate.json"
else
  note "end-to-end decode: rc=$rc, no table"; status=1
fi

# -- 5. serving attention over GEAR pages ------------------------------------------------------------------------
echo ">> serving attention (timeout 60s)"
echo "== bench_paged_attention.py ==" >> "$OUT/bench.log"
timeout -k 10 60 "$PY" scripts/bench_paged_attention.py --out "$SCRATCH/paged" --requests 32 --context 4096 \
  >> "$OUT/bench.log" 2>&1
rc=$?
if [ -s "$SCRATCH/paged/bench_paged_attention.json" ]; then
  "$PY" - "$SCRATCH/paged/bench_paged_attention.json" "$OUT/bench_gpu_generate.json" <<'EOF'
import json, sys
from pathlib import Path
paged, target = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
merged = json.loads(target.read_text()) if target.exists() else {}
merged["paged_attention"] = paged
target.write_text(json.dumps(merged, indent=1))
EOF
  note "serving attention: rc=$rc, $(grep -c '"method"' "$SCRATCH/paged/bench_paged_attention.json") rows (bench_gpu_generate.json: paged_attention)"
else
  note "serving attention: rc=$rc, no table"; status=1
fi
if "$PY" -c "import sys; from vllm.platforms import current_platform as p; sys.exit(0 if p.is_cuda() else 1)" \
    > /dev/null 2>&1; then
  note "vLLM with CUDA is installed here: the engine-level serving run is not scripted (scripts/bench_vllm.py is CPU)"
else
  note "vLLM serving on the GPU: skipped (no CUDA build of vLLM on this machine)"
fi
rm -rf "$SCRATCH"

note "total $((SECONDS - START))s"
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
exit $status
