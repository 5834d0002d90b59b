"""Measure compression where its error is consumed: attention scores, attention output, next token.

* `capture`: `capture_qkv` records every layer's queries, keys (before RoPE) and values for a text;
  `stream_steps` is the schedule a cache is filled with (prompt at prefill, then chunks).
* `errors`: `layer_errors` (per layer: K, V and attention-output error of the last queries) and `head_errors`
  (per layer x head, step by step as the cache is filled: K/V reconstruction, scores, probabilities, output;
  each query against exactly what the cache handed the attention at that step).
* `kl`: the next-token KL path (stock vs GEAR, teacher forced through the real model and the real streaming
  cache): `next_token_kl` (everything, one layer or one KV head compressed), `kl_map`, `teacher_forced_agreement`.
* `report`: `diagnose` runs them all; `write_report` writes a CSV, a Markdown summary and heatmaps.
* `cli`: `python -m gear_hf.diagnostics --model smollm2 --method gear-2` (writes to out/diagnostics/ by default).
"""

from .capture import LayerCapture, capture_qkv, stream_steps
from .cli import main
from .errors import head_errors, layer_errors
from .kl import (
                 SelectiveGearCache,
                 kl_divergence,
                 kl_map,
                 next_token_kl,
                 stock_logits,
                 streamed_logits,
                 teacher_forced_agreement,
)
from .report import KV_METRICS, METRIC_DOC, METRICS, Diagnosis, diagnose, heatmap, layer_means, write_report

__all__ = ["LayerCapture", "capture_qkv", "stream_steps", "head_errors", "layer_errors", "SelectiveGearCache",
           "kl_divergence", "kl_map", "next_token_kl", "stock_logits", "streamed_logits", "teacher_forced_agreement",
           "KV_METRICS", "METRIC_DOC", "METRICS", "Diagnosis", "diagnose", "heatmap", "layer_means", "write_report",
           "main"]
