"""What the measured frontier says to pick: `RECOMMENDED` (name, bits/element owned, GearConfig fields) and the
name `GearConfig()` is (`DEFAULT_RECOMMENDED`); `GearConfig.recommended` reads them. Data only (gear_hf.config
imports it)."""

from __future__ import annotations

from typing import Any

# What the measured frontier says to pick (scripts/frontier.py; SmolLM2-135M and Qwen2.5-0.5B in bf16, head_dim 64,
# teacher-forced next-token KL over the last 128 tokens of three GSM8K texts, T=1028 = 4 sinks + 1024; docs/results.md
# "Accuracy per byte", results/frontier/frontier_texts.md): (name, bits/element OWNED, fields over the paper's with
# int8 low-rank factors), cheapest first. The bits are the mean of `memory_report()["bits_per_element"]` (held +
# spare + workspaces) over the decode steps from T=1024 to 4096 after a 1024-token prompt, bf16, head_dim 64
# (`python scripts/bench_footprint.py`, results/footprint/; head_dim 128 owns 0.1-0.4 less, gear-4 0.4 less), so
# `recommended(bits_per_element=b)` returns a configuration owning <= b on average over such a run (the positions,
# which follow from the pads in such a run, are not stored: issue 25 item 5). At T~1k a 16-bit buffer (up to
# buffer_size tokens) adds up to 1.2 bits more (results/footprint/ "max owned").
# The buffer's format (key_buffer/value_buffer, issue 25) measured as points (scripts/bench_tail.py, SmolLM2 bf16,
# 1024-token prompt + 96 teacher-forced steps through the 30-layer cache, GSM8K texts 0 / 1 / 200; results/tail/),
# bits owned mean / max over the steps, KL per text:
#   "accurate", 16-bit buffer (GearConfig() of config version 1)   4.018 / 5.011  0.0084 / 0.0038 / 0.0074
#   "accurate", 8-bit keys + 4-bit rotated values in the buffer    3.590 / 3.830  0.0107 / 0.0094 / 0.0085
#   "lean" (k2.875, values per channel, ranges searched; same buffer) 3.313 / 3.571  0.0128 / 0.0151 / 0.0113
#   kivi-4 (paper preset, 16-bit buffer)                            4.789 / 5.172  0.0113 / 0.0096 / 0.0132
# GearConfig() (config version 2) is "accurate" with that buffer: below kivi-4's KL on all three texts at 0.75x its
# bits, 3.55 on average from T=1024 to 4096, but above 3.6 while its buffer is more than about half full (up to 3.83
# at T~1.1k, 3.69 on head_dim 128). "lean" owns <= 3.6 at every step and
# pays for it in KL (above kivi-4's on texts 0 and 1). No point measured does both (results/tail/). 4-bit keys in the
# buffer (re-quantized into every chunk) raised KL 5x; a 64-token buffer raised it 1.4x.
# Config version 4 rotates the 8-bit keys in the buffer (key_buffer="int8-rotated"): unrotated, Qwen2.5's few large key
# channels set each token's range and its KL was 15-50x kivi-4's (results/tail/ "Rotated 8-bit keys"; SmolLM2 pays
# 1.07x for the rotation). "steady" (GearConfig() from config version 5) is "accurate" with keys flushing every 64
# tokens (64-token key groups: group_size capped at the buffer) while values stay buffered one chunk longer
# (value_buffer_size=128: 64..127 values at 4 bits) and 8-bit value statistics: on the fused CPU path (96 steps after
# a 1,024-token prompt) it owns 3.488 / 3.593 bits (mean / max), against "accurate"'s 3.590 / 3.830 and kivi-4's
# 4.789 / 5.172, at mean KL 0.0108 on eight SmolLM2 texts ("accurate" 0.0123, kivi-4 0.0133) and 0.0053 on three
# Qwen2.5 texts ("accurate" 0.0063, kivi-4 0.0038); over T=1024..4096 3.515 mean, 3.605 max (a chunk store's bounded
# growth), 3.448 / 3.536 on d=128. The numba and Triton kernels read the held chunk fused; the vLLM plugin compresses a
# block's values with its keys. Its "auto" fields follow the buffer: recommended("steady", buffer_size=32) holds 64.
# All keep 4 attention-sink tokens exact, group keys by 128 tokens ("steady": 64) and rotate the values. All
# but "small" give each key channel its own width, chosen
# from the prompt's queries (key_bit_allocation="query", keys unrotated: measured at the same bits, it cut KL 2-4x
# against one width for every channel, e.g. k3v3 0.0271 -> 0.0073 on SmolLM2 and 0.0140 -> 0.0048 on Qwen, text 0).
# All group the prompt chunk by 256 tokens (prompt_group_size). "compact" and "balanced" store values like keys
# (per channel over token groups, value_axis="channel", ranges searched): statistics of 1/8 + 1/8 bit per element on
# the prompt ("lean" too). "accurate" (the default) and "precise" keep 3-bit values per token
# with min/max ranges, nothing searched at compress time (the search costs ~50x a min/max quantization of the same
# chunk): "accurate" is below kivi-4's KL
# on all six model/text pairs and at T=4100 with 1.1 bit less (measured with the 16-bit buffer); with values per
# channel and searched at the same bits (k3.5v3) the KL was lower on one pair of six.
# "held" (GearConfig() from config version 6) is "steady" with its keys held a chunk longer too (key_buffer_size=128:
# each row's newest 64..127 keys at 8 bits, rotated, as its values at 4), paid for by 2.75-bit keys in the chunks
# (session 26 found Qwen2.5's KL gap in the newest decode chunk's keys). Fused CPU path, bf16, 1,024-token prompt + 96
# teacher-forced steps, side by side on one machine (results/tail/ "Keys held a chunk longer", "More texts"): 3.459 /
# 3.577 bits owned (mean / max; "steady" 3.488 / 3.593); mean KL over 24 SmolLM2 GSM8K texts 1.00x kivi-4's
# ("steady" 1.07x), over 11 Qwen2.5 texts 1.08x ("steady" 1.05x). Over T=1024..4096: 3.403 mean / 3.577 max on d=64
# ("steady" 3.515 / 3.605), 3.332 / 3.491 on d=128. With 3.125-bit keys (key_bits unchanged) held keys were below
# kivi-4 on 2 of 3 Qwen2.5 texts and 7 of 8 SmolLM2 ones but own 3.630 / 3.741.
# "held-early" (GearConfig() from config version 7) is "held" with both held chunks released half a chunk after they
# are held (held_for=0.5: the buffers hold at most 95 tokens, not 127, and the owned bits peak right before a chunk
# leaves them), paid for by 3-bit keys in the chunks. Same conditions (results/tail/ "Held chunks released early"):
# 3.506 / 3.586 bits owned over the 96 steps; mean KL over 24 SmolLM2 texts 0.87x kivi-4's (16 of 24 texts at or
# below it; "held" 1.00x, 12), over 31 Qwen2.5 texts 1.31x ("held" 1.34x: kivi-4 is below every configuration
# measured at <= 3.6 bits there); 0.87x / 0.98x "held"'s on the same texts. Over T=1024..4096: 3.479 mean / 3.587
# max on d=64, 3.411 / 3.518 on d=128. Keys held a whole chunk with 2.875-bit keys read better on Qwen2.5 (0.90x
# "held"'s over 31 texts) but own 3.631 at T~1k; released after 48 tokens with 2.875-bit keys they lose that (1.04x).
# "centered" (GearConfig() from config version 8) is "held-early" with its key buffer centered and scaled per channel
# (key_buffer_centered: each row's channel means and power-of-two scales from its prompt, 3 bytes per channel; Qwen2's
# key bias no longer sets every buffered token's 8-bit range). Same conditions (results/tail/ "Keys centered in the
# buffer"): 3.517 / 3.597 bits owned over the 96 steps; mean KL over 31 Qwen2.5 texts 1.07x kivi-4's (95% interval
# 0.94-1.22; 0.82x "held-early"'s, lower on 24 of 31), over 24 SmolLM2 texts 0.90x (1.04x "held-early"'s, within the
# noise). Over T=1024..4096: 3.485 mean / 3.597 max on d=64, 3.417 / 3.521 on d=128.
# "centered-kv" (GearConfig() from config version 9) centers the value buffer too (value_buffer_centered: each row's
# value means, an int8 code a channel; the keys' exponents then take 4 bits a channel, so it owns what "centered" did
# before: 3.486 / 3.599 over T=1024..4096 on d=64, 3.418 / 3.521 on d=128; "centered" now 3.484 / 3.595):
# results/tail/ "Where Qwen2.5's KL still goes under "centered", and the value buffer centered too".
# "centered-chunks" (GearConfig() from config version 10) codes the value chunks by the value buffer's centers too
# (value_chunks_centered: no byte more, so it owns what "centered-kv" does). Same conditions (results/tail/ "The value
# chunks centered too"): mean KL over 31 Qwen2.5 texts 0.93x kivi-4's (95% interval 0.81-1.06; 0.91x "centered-kv"'s,
# 0.83-1.00), over 24 SmolLM2 texts 0.82x (0.99x "centered-kv"'s, within the noise).
_ALLOCATED = dict(method="kivi", key_bit_allocation="query", rotation="values", group_size=128, sink_tokens=4,
                  prompt_group_size=256)
_COMPACT = dict(_ALLOCATED, value_axis="channel", range_search="values")
_HELD_EARLY = dict(_ALLOCATED, key_bits=3, value_bits=3, key_buffer="int8-rotated", value_buffer="int4", buffer_size=64,
                   value_buffer_size="auto", value_statistics="auto", key_buffer_size="auto", held_for="auto")
RECOMMENDED: tuple[tuple[str, float, dict[str, Any]], ...] = (
    ("small", 2.79, dict(method="kivi", key_bits=2, value_bits=2, rotation="values", range_search="values",
                         group_size=128, sink_tokens=4)),
    ("compact", 2.89, dict(_COMPACT, key_bits=2.5, value_bits=2)),
    ("balanced", 3.13, dict(_COMPACT, key_bits=3, value_bits=2)),
    ("lean", 3.28, dict(_COMPACT, key_bits=2.875, value_bits=3, key_buffer="int8-rotated", value_buffer="int4")),
    ("held", 3.40, dict(_ALLOCATED, key_bits=2.75, value_bits=3, key_buffer="int8-rotated", value_buffer="int4",
                        buffer_size=64, value_buffer_size="auto", value_statistics="auto", key_buffer_size="auto",
                        held_for=1.0)),
    ("held-early", 3.48, _HELD_EARLY),
    # (three decimals where the measured means lie closer than the table's usual 0.01)
    ("centered", 3.484, dict(_HELD_EARLY, key_buffer_centered=True)),
    ("centered-kv", 3.486, dict(_HELD_EARLY, key_buffer_centered=True, value_buffer_centered=True)),
    ("centered-chunks", 3.486, dict(_HELD_EARLY, key_buffer_centered=True, value_buffer_centered=True,
                                    value_chunks_centered=True)),
    ("steady", 3.51, dict(_ALLOCATED, key_bits=3.125, value_bits=3, key_buffer="int8-rotated", value_buffer="int4",
                          buffer_size=64, value_buffer_size="auto", value_statistics="auto")),
    ("accurate", 3.55, dict(_ALLOCATED, key_bits=3.125, value_bits=3, key_buffer="int8-rotated", value_buffer="int4")),
    ("precise", 4.00, dict(_ALLOCATED, key_bits=3.5, value_bits=3)),
    ("kivi-4", 4.68, dict(method="kivi", key_bits=4, value_bits=4)),
    ("gear-4", 6.12, dict(method="gear", key_bits=4, value_bits=4, factor_bits=16)),
)
# what GearConfig() and gear_hf.enable(model) use (config version 10; 9: "centered-kv", 8: "centered", 7: "held-early",
# 6: "held", 5: "steady", 4: "accurate")
DEFAULT_RECOMMENDED = "centered-chunks"
