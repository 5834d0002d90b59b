"""Shared helpers of the scripts/bench_*.py drivers, scripts/ablation.py and scripts/sweep.py (not a benchmark).

* `conditions`: what a result depends on (CPU, threads, versions, load average, whether the machine was shared).
* `report`: CSV / Markdown / summary files, medians and quantiles.
* `data`: GSM8K prompts and texts (through gear_hf.gsm8k), fixed-length batches, models by name.
* `methods`: methods by name (DynamicCache, HF QuantizedCache backends, gear_hf presets) and one timed generate.
* `memory`: peak RSS during a call, an independent count of the bytes of the tensors an object holds.
* `cli`: the default output folder (out/, untracked) and options meant for other benchmarks.
"""

from pathlib import Path  # noqa: F401  (scripts use benchlib.Path)

from .cli import OUT, REPO, add_out_argument, config_names, parse_bench_args
from .conditions import Conditions, cpu_model, load_average, print_conditions
from .data import data_dir, fixed_length_batch, gsm8k_prompts, gsm8k_text, load_model, long_text
from .memory import PeakRSS, release_free_memory, tensor_bytes
from .methods import (
                      GEAR_PRESETS,
                      HF_METHODS,
                      GenerateResult,
                      check_method,
                      gear_config,
                      hf_backend_available,
                      make_hf_quantized_cache,
                      method_bits,
                      run_generate,
                      select_methods,
                      warm_up,
)
from .report import markdown_table, median, quantile, write_csv, write_summary
