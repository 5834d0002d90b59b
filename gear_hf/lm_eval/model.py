"""The `gear_hf` lm-eval model: lm-eval's own `hf` model (HFLM) whose generation runs over a GEAR cache.

    --model gear_hf --model_args pretrained=DIR,preset=gear,bits=2,buffer_size=64[,gguf_file=F.gguf,dtype=...]

* The model is loaded exactly as `--model hf` loads it (`pretrained` stays a string, so accelerate data
  parallelism still works; `gguf_file=` loads GGUF weights and their tokenizer), then `gear_hf.enable`
  patches it in place. `generate` then builds a GEAR cache; loglikelihood calls pass no cache and run the
  stock forward, so loglikelihood tasks score exactly as with `hf`.
* GEAR keys (`preset`/`method`, `bits`, every GearConfig field) are validated before the weights load.
* Data parallelism also across CPU processes (see `sharding`).
* Before the first timed generate of a config, one untimed warm-up generate runs (`gear_warmup=false` skips it),
  so tokens/s excludes kernel compilation; its seconds are reported apart (`warmup_seconds`, of which
  `compile_seconds` numba compiling; `timed_compile_seconds`: what the timed calls compiled, 0 when the warm-up
  reached every kernel they use).
* `get_model_info()` adds the GEAR config (`GearConfig.to_dict()`), how it was named (`gear_name`:
  "recommended=smallest", "preset=gear-2", "default") and generation statistics (generated tokens, tokens/s, the
  warm-up's seconds, KV bits per element from the cache's `memory_report`) to lm-eval's results["config"]; under
  data parallelism these statistics are rank 0's share.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from gear_hf.config import GearConfig
from gear_hf.lm_eval import sharding
from gear_hf.lm_eval.args import WARMUP_KEY, ModelArgsError, config_name, gear_keys, split_model_args
from gear_hf.lm_eval.args import convert_flag as _flag

log = logging.getLogger(__name__)
# get_model_info() of the last GearHFLM (lm-eval calls it on rank 0 when the run ends); `gear-lm-eval` prints it.
LAST_MODEL_INFO: dict | None = None


@dataclasses.dataclass
class GenerationStats:
    """What the GEAR-cached generate calls did (this process only)."""

    calls: int = 0
    sequences: int = 0
    new_tokens: int = 0
    seconds: float = 0.0  # of the timed generate calls: the warm-up is not in it
    warmup_seconds: float | None = None  # the untimed warm-up generate (kernel compilation, first-call set-up)
    warmup_tokens: int = 0
    compile_seconds: float = 0.0  # of those, numba compiling CPU kernels (0 after `python -m gear_hf.warmup`)
    timed_compile_seconds: float = 0.0  # kernels compiled during the timed calls (0: the warm-up reached them all)
    kv_reports: int = 0
    kv_bits_sum: float = 0.0  # sum of the reports' bits_per_element, each weighted by its elements
    kv_elements: int = 0

    @property
    def tokens_per_second(self) -> float | None:
        return self.new_tokens / self.seconds if self.seconds > 0 else None

    @property
    def kv_bits_per_element(self) -> float | None:
        """Over all generate calls: the caches' `memory_report()["bits_per_element"]`, weighted by the elements
        each cache held (what its tokens hold, so it follows the tokens generated)."""
        return self.kv_bits_sum / self.kv_elements if self.kv_elements else None

    def add_report(self, report: dict) -> None:
        bits = report.get("bits_per_element")
        if bits is None:
            return
        weight = int(report.get("elements") or 1)
        self.kv_reports += 1
        self.kv_bits_sum += float(bits) * weight
        self.kv_elements += weight

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["tokens_per_second"] = self.tokens_per_second
        out["kv_bits_per_element"] = self.kv_bits_per_element
        return out


def _api():
    import gear_hf

    missing = [name for name in ("enable", "disable", "last_cache") if not hasattr(gear_hf, name)]
    if missing:
        raise RuntimeError(f"gear_hf.{missing[0]} is not available in this installation of gear_hf")
    return gear_hf


@register_model("gear_hf", "gear-hf")
class GearHFLM(HFLM):
    """HFLM + `gear_hf.enable(model, GearConfig)`; see the module docstring for the model arguments."""

    def __init__(self, pretrained: Any = None, gear_config: GearConfig | None = None, **kwargs: Any) -> None:
        if pretrained is None:
            raise ModelArgsError("gear_hf --model_args: pretrained=<model dir or hub id> is required")
        warmup = kwargs.pop(WARMUP_KEY, True)
        if gear_config is not None:
            if any(k in kwargs for k in gear_keys()):
                raise ModelArgsError("gear_hf: give gear_config or GEAR --model_args keys, not both")
            _, hf_kwargs = split_model_args(kwargs)
            config, name = gear_config, gear_config.describe()
        else:
            config, hf_kwargs = split_model_args(kwargs)
            name = config_name(kwargs)
        self.gear_warmup = _flag(WARMUP_KEY, warmup)
        if isinstance(pretrained, (int, float)) and not isinstance(pretrained, bool):
            pretrained = str(pretrained)
        if hf_kwargs.get("device") is None:  # HFLM's default "cuda" fails on a machine without CUDA
            import torch

            hf_kwargs["device"] = "cuda" if torch.cuda.is_available() else "cpu"
        sharding.prepare_process_group()
        super().__init__(pretrained=pretrained, **hf_kwargs)
        sharding.shard_across_processes(self)
        self.gear_config: GearConfig | None = None
        self.gear_stats = GenerationStats()
        self.set_gear_config(config, name)

    # GEAR ---------------------------------------------------------------------------------------------------------
    def set_gear_config(self, config: GearConfig, name: str | None = None) -> None:
        """(Re)patch the loaded model with `config` (the sweep reuses one loaded model for every cell); name: how the
        user named it ("recommended=smallest"; default: config.name), recorded as gear_name."""
        api = _api()
        if self.gear_config is not None:
            api.disable(self.model)
        api.enable(self.model, config)
        self.gear_config = config
        self.gear_name = name or config.name
        self.gear_stats = GenerationStats()
        if self.rank == 0:
            log.info("gear_hf: %s (%s)", self.gear_name, config)

    def _record_generation(self, context, out, seconds: float) -> None:
        stats = self.gear_stats
        stats.calls += 1
        stats.seconds += seconds
        new = out[:, context.shape[1]:]
        stats.sequences += new.shape[0]
        pad = self.tokenizer.pad_token_id
        for row in new.tolist():
            n = len(row)
            while n and pad is not None and row[n - 1] == pad:
                n -= 1
            stats.new_tokens += n
        cache = _api().last_cache(self.model)  # None when this generate ran without GEAR
        if cache is not None:
            stats.add_report(cache.memory_report())

    def _warm_up(self, context) -> None:
        """One untimed greedy generate before the first timed one of this config (`gear_hf.measure.warm_up`: row 0's
        last tokens, long enough to compress a prompt chunk, and enough new tokens to flush the buffer once), so
        that tokens/s excludes kernel compilation (numba on CPU, Triton on CUDA) and first-call set-up."""
        from gear_hf.measure import warm_up

        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        warm = warm_up(self.model, context, self.gear_config, pad_token_id=pad)
        self.gear_stats.warmup_seconds, self.gear_stats.compile_seconds = warm.seconds, warm.compile_seconds
        self.gear_stats.warmup_tokens = warm.tokens
        if self.rank == 0:
            log.info("gear_hf: warm-up generate took %.1f s (%.1f s of it compiling kernels); not counted in tokens/s",
                     self.gear_stats.warmup_seconds, self.gear_stats.compile_seconds)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        if self.gear_warmup and self.gear_stats.warmup_seconds is None:
            self._warm_up(context)
        from gear_hf.warmup import CompileWatch

        start = time.perf_counter()
        with CompileWatch() as watch:
            out = super()._model_generate(context, max_length, stop, **generation_kwargs)
        self._record_generation(context, out, time.perf_counter() - start)
        self.gear_stats.timed_compile_seconds += watch.seconds
        return out

    def get_model_info(self) -> dict:
        info = super().get_model_info()
        if self.gear_config is not None:
            info["gear_config"] = self.gear_config.to_dict()
            info["gear_method"] = self.gear_config.describe()
            info["gear_name"] = self.gear_name
        info["gear_stats"] = {**self.gear_stats.as_dict(), "gear_name": getattr(self, "gear_name", None)}
        info["gear_world_size"] = self.world_size
        global LAST_MODEL_INFO
        LAST_MODEL_INFO = info
        return info
