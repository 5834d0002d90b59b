"""torch.compile of an enabled model's forward: same tokens, no graph break in gear_hf, no recompilation.

Under compile each layer's cache step (host-side planning, numba kernels, the finiteness check, backend resolution)
is one opaque operator in the graph (`torch.ops.gear_hf.cache_step`, gear_hf/attention.py), taking the cache and
the module as reference opaque objects (gear_hf/step_ref.py). These tests count every graph break dynamo logs whose
innermost user frame is a gear_hf file (gear_hf/ or patches/): there must be none; fullgraph=True compiles; a new
cache (every generate) reuses the compiled graphs; the operator's fake output matches the real one.

backend="eager" (or a recording backend on top of it): dynamo captures and breaks graphs exactly as with inductor
(breaks are decided while tracing, before any backend runs), without inductor's C++ compilation, which takes
minutes on this machine's two cores. "aot_eager" runs AOT autograd's functionalization and effect tokens too.
"""

from __future__ import annotations

import collections
import copy
import logging
import os
import re

import pytest
import torch
from torch._dynamo.utils import counters

import gear_hf
import gear_hf.attention  # registers torch.ops.gear_hf.cache_step
import gear_hf.patches
from tiny_models import tiny_model, tiny_model_or_skip

GEAR_HF_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (gear_hf, gear_hf.patches))
BREAK_LOGGERS = ("torch._dynamo.symbolic_convert.__graph_breaks", "torch._dynamo.convert_frame.__graph_breaks")
SITE = re.compile(r"in user code at (\S+):(\d+)")
CACHE_STEP_OPS = (torch.ops.gear_hf.cache_step, torch.ops.gear_hf.cache_step.default)  # dynamo records the first


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

    def in_gear_hf(self) -> dict[tuple[str, int], str]:
        return {site: reasons[0][:600] for site, reasons in self.sites.items() if site[0].startswith(GEAR_HF_DIRS)}


def _strides(x: torch.Tensor) -> list[int]:
    return [stride for stride, size in zip(x.stride(), x.shape) if size > 1]  # a size-1 dim's stride is arbitrary


class CheckedGraphs:
    """A dynamo backend: runs each captured graph node by node (torch.fx.Interpreter) and checks every cache step
    operator's real output against the fake output dynamo traced with (shape, dtype, strides)."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.op_calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        checked = self

        class Interpreter(torch.fx.Interpreter):
            def run_node(self, node):
                result = super().run_node(node)
                if node.target in CACHE_STEP_OPS:
                    fake = node.meta["example_value"]
                    assert (result.shape, result.dtype, _strides(result)) == (fake.shape, fake.dtype, _strides(fake))
                    checked.op_calls += 1
                return result

        return lambda *args: Interpreter(gm).run(*args)

    def ops_in_graphs(self) -> int:
        return sum(node.target in CACHE_STEP_OPS for gm in self.graphs for node in gm.graph.nodes)


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


def _generate(model, ids, new_tokens=6, **kwargs):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0, **kwargs)


def _compiled(model, backend="eager", fullgraph=False):
    model.forward = torch.compile(model.forward, backend=backend, fullgraph=fullgraph)  # (why eager: docstring)
    return model


def _prompt(length=160):
    # head_dim 32 (the models below): the fused numba attention serves the decode steps; a 160-token prompt:
    # GearConfig() (buffer 128) compresses a 128-token chunk at prefill, so the compiled decode steps read it
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("preset", ["fp16", "default"])
def test_compiled_forward_same_tokens_and_no_graph_break_in_gear_hf(graph_breaks, preset):
    model, ids = tiny_model("llama2", head_dim=32), _prompt()
    config = gear_hf.GearConfig.preset("fp16") if preset == "fp16" else gear_hf.GearConfig()
    expected = _generate(model, ids) if preset == "fp16" else None  # fp16 is stock attention bit for bit
    gear_hf.enable(model, config)
    if expected is None:
        expected = _generate(model, ids)  # a compressing config: its own eager run
    backend = CheckedGraphs()
    tokens = _generate(_compiled(model, backend), ids)
    cache = gear_hf.last_cache(model)
    assert torch.equal(tokens, expected)
    assert graph_breaks.in_gear_hf() == {}
    # every layer's step is the operator, in the prefill graph and the decode graph, and ran each forward
    assert backend.ops_in_graphs() == 2 * len(model.model.layers)
    assert backend.op_calls == 6 * len(model.model.layers)  # 1 prompt + 5 decode forwards (6 new tokens)
    if preset == "default":
        assert cache.decode_chunks[0] > 0 and cache.step_paths["fused"] > 0  # compressed, read by the fused kernel


def test_break_log_capture_sees_the_one_fallback(graph_breaks):
    # output_attentions=True: weights whose length the graph cannot know; the step takes the compiler-disabled call
    # (one graph break per layer in gear_hf/attention.py). Also shows the capture above would see a gear_hf break.
    model, ids = tiny_model("llama2", attn="eager", head_dim=32), _prompt(24)
    gear_hf.enable(model, gear_hf.GearConfig.preset("fp16"))
    expected = _generate(model, ids, output_attentions=True, return_dict_in_generate=True)
    result = _generate(_compiled(model), ids, output_attentions=True, return_dict_in_generate=True)
    assert torch.equal(result.sequences, expected.sequences)
    assert all(torch.equal(a, b) for step_a, step_b in zip(result.attentions, expected.attentions)
               for a, b in zip(step_a, step_b))
    sites = graph_breaks.in_gear_hf()
    assert {os.path.basename(path) for path, _ in sites} == {"attention.py"}
    assert all("cache_step" in reason for reason in sites.values())


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_fullgraph_under_inference_mode_no_recompile_for_new_caches(backend):
    # fullgraph=True: any graph break anywhere would raise. Two generates (two new caches) and a deepcopy'd model:
    # the graphs compiled for the first cache serve the rest (dynamo guards on a StepRef's type, not its identity)
    model, ids = tiny_model("llama2", head_dim=32), _prompt()
    gear_hf.enable(model, gear_hf.GearConfig())
    expected = _generate(model, ids)
    twin = copy.deepcopy(model)
    torch._dynamo.reset()
    counters.clear()
    try:
        _compiled(model, backend, fullgraph=True)
        with torch.inference_mode():
            first = _generate(model, ids)
            graphs = counters["stats"]["unique_graphs"]
            second = _generate(model, ids)
        assert counters["stats"]["unique_graphs"] == graphs  # no recompilation for the second cache
        assert torch.equal(first, expected) and torch.equal(second, expected)
        assert gear_hf.last_cache(model).step_paths["fused"] > 0
        twin_tokens = _generate(_compiled(twin, backend, fullgraph=True), ids)
        assert torch.equal(twin_tokens, expected)
        assert gear_hf.last_cache(twin) is not gear_hf.last_cache(model)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("arch", ["mistral", "qwen3_moe", "gemma3_text", "phi3"])
def test_fullgraph_other_architectures_fp16_preset_is_stock(arch):
    # a sliding window, a MoE (its layers pass output_router_logits), local/global RoPE, a fused qkv_proj
    model, ids = tiny_model_or_skip(arch, head_dim=32), _prompt(40)
    expected = _generate(model, ids)
    gear_hf.enable(model, gear_hf.GearConfig.preset("fp16"))
    torch._dynamo.reset()
    try:
        assert torch.equal(_generate(_compiled(model, fullgraph=True), ids), expected)
    finally:
        torch._dynamo.reset()


def test_fullgraph_left_padded_batch_same_tokens_as_eager():
    # rows of different lengths: the model's 4D mask goes into the operator, decode steps use the slot layout
    model, ids = tiny_model("llama2", head_dim=32), _prompt(160).repeat(2, 1)
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    gear_hf.enable(model, gear_hf.GearConfig())
    with torch.no_grad():
        expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                  pad_token_id=0)
        torch._dynamo.reset()
        try:
            tokens = _compiled(model, fullgraph=True).generate(input_ids=ids, attention_mask=mask, max_new_tokens=6,
                                                                do_sample=False, pad_token_id=0)
        finally:
            torch._dynamo.reset()
    assert torch.equal(tokens, expected)
    assert gear_hf.last_cache(model).decode_chunks[0] > 0


def test_step_refs_follow_deepcopies():
    model = gear_hf.enable(tiny_model("llama2"), gear_hf.GearConfig.preset("fp16"))
    twin = copy.deepcopy(model)
    for original, copied in zip(model.model.layers, twin.model.layers):
        assert original.self_attn._gear_hf_patch.step_ref.target is original.self_attn
        assert copied.self_attn._gear_hf_patch.step_ref.target is copied.self_attn
    cache = gear_hf.GearCache(model)
    assert copy.deepcopy(cache).step_ref.target is not cache and cache.step_ref.target is cache


def test_non_finite_keys_still_raise_under_compile(graph_breaks):
    model, ids = tiny_model("llama2"), _prompt(24)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[0, :] = float("nan")
    gear_hf.enable(model, gear_hf.GearConfig.preset("gear", bits=2, group_size=8, buffer_size=8))
    with pytest.raises(ValueError, match=r"non-finite keys/values \(NaN or inf\)"):
        _generate(_compiled(model), ids)
    assert graph_breaks.in_gear_hf() == {}
