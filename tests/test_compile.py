"""torch.compile of an enabled model's forward (issue 27): same tokens, and no graph break inside gear_hf.

The cache step of each layer (`gear_hf.attention.cache_step`: host-side planning, numba kernels, the finiteness
check, backend resolution) is wrapped in `torch.compiler.disable`: dynamo breaks the graph once at that call and
compiles the model's code around it. These tests count every graph break dynamo logs whose innermost user frame is
a gear_hf file (gear_hf/ or patches/) and require each to be that one boundary call.

backend="eager": dynamo captures and breaks graphs exactly as with inductor (breaks are decided while tracing, before
any backend runs), without inductor's C++ compilation, which takes minutes on this machine's two cores.
"""

from __future__ import annotations

import collections
import logging
import os
import re

import pytest
import torch

import gear_hf
import gear_hf.patches
from tiny_models import tiny_model

GEAR_HF_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (gear_hf, gear_hf.patches))
BREAK_LOGGERS = ("torch._dynamo.symbolic_convert.__graph_breaks", "torch._dynamo.convert_frame.__graph_breaks")
SITE = re.compile(r"in user code at (\S+):(\d+)")


class GraphBreaks(logging.Handler):
    """Collects dynamo's graph-break log records: (file, line) of the innermost user frame -> reasons."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.sites: dict[tuple[str, int], list[str]] = collections.defaultdict(list)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        site = SITE.search(message)
        if site:
            self.sites[(site.group(1), int(site.group(2)))].append(message)

    def in_gear_hf(self) -> dict[tuple[str, int], list[str]]:
        return {site: reasons for site, reasons in self.sites.items() if site[0].startswith(GEAR_HF_DIRS)}

    def inside_gear_hf(self) -> dict[tuple[str, int], str]:
        """Breaks in gear_hf files other than the call of the one boundary (`cache_step`, compiler-disabled)."""
        return {site: reasons[0][:600] for site, reasons in self.in_gear_hf().items()
                if not all("torch.compiler.disable" in r and "cache_step" in r for r in reasons)}


@pytest.fixture
def graph_breaks():
    torch._dynamo.reset()
    handler = GraphBreaks()
    torch._logging.set_logs(graph_breaks=True)
    for name in BREAK_LOGGERS:
        logging.getLogger(name).addHandler(handler)
    try:
        yield handler
    finally:
        for name in BREAK_LOGGERS:
            logging.getLogger(name).removeHandler(handler)
        torch._logging.set_logs()
        torch._dynamo.reset()


def _generate(model, ids, new_tokens=6):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)


def _compiled(model):
    model.forward = torch.compile(model.forward, backend="eager", fullgraph=False)  # (why eager: module docstring)
    return model


@pytest.mark.parametrize("preset", ["fp16", "default"])
def test_compiled_forward_same_tokens_and_no_graph_break_inside_gear_hf(graph_breaks, preset):
    # head_dim 32: the fused numba attention serves the decode steps; a 160-token prompt: GearConfig() (buffer 128)
    # compresses a 128-token chunk at prefill, so the compiled decode steps read compressed storage
    model = tiny_model("llama2", head_dim=32)
    ids = torch.randint(3, 128, (1, 160), generator=torch.Generator().manual_seed(0))
    config = gear_hf.GearConfig.preset("fp16") if preset == "fp16" else gear_hf.GearConfig()
    expected = _generate(model, ids) if preset == "fp16" else None  # fp16 is stock attention bit for bit
    gear_hf.enable(model, config)
    if expected is None:
        expected = _generate(model, ids)  # a compressing config: its own eager run
    tokens = _generate(_compiled(model), ids)
    cache = gear_hf.last_cache(model)
    assert torch.equal(tokens, expected)
    assert graph_breaks.sites, "dynamo logged no graph break at all: the log capture is broken"
    assert graph_breaks.inside_gear_hf() == {}
    assert graph_breaks.in_gear_hf(), "the cache step ran traced: the boundary call was not seen"
    if preset == "default":
        assert cache.decode_chunks[0] > 0 and cache.step_paths["fused"] > 0  # compressed, read by the fused kernel


def test_non_finite_keys_still_raise_under_compile(graph_breaks):
    model = tiny_model("llama2")
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[0, :] = float("nan")
    gear_hf.enable(model, gear_hf.GearConfig.preset("gear", bits=2, group_size=8, buffer_size=8))
    with pytest.raises(ValueError, match=r"non-finite keys/values \(NaN or inf\)"):
        _generate(_compiled(model), ids)
