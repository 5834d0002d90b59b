"""The page format and the step plan, without an engine: exact fp16 pages, fixed-size deterministic GEAR pages
that reuse gear_hf.compress bit for bit, bad configs named, and the tail bookkeeping of a step."""

from __future__ import annotations

import pytest
import torch

from gear_hf.compress import decompress
from gear_hf.config import GearConfig
from gear_hf.vllm.format import PageFormat, chunk_specs, config_from_env
from gear_hf.vllm.plan import StepPlan, TailBook

BS, D = 32, 64


def _blocks(n=3, heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, heads, BS, D, generator=g)
    k[..., 5] *= 8  # an outlier channel, as keys have
    return k.bfloat16(), torch.randn(n, heads, BS, D, generator=g).bfloat16()


def test_fp16_pages_are_exact():
    fmt = PageFormat(GearConfig(method="fp16"), BS, D, torch.bfloat16)
    k, v = _blocks()
    k2, v2 = fmt.decode(fmt.encode(k, v))
    assert torch.equal(k, k2) and torch.equal(v, v2)
    assert fmt.page_bytes == 2 * BS * D * 2


@pytest.mark.parametrize("text", ['{"preset": "gear-2"}', '{"preset": "kivi-4"}', "", '{"recommended": "small"}',
                                  '{"preset": "outlier-2"}'])
def test_gear_pages_are_fixed_size_deterministic_and_close(text):
    config = config_from_env(text)
    fmt = PageFormat(config, BS, D, torch.bfloat16)
    k, v = _blocks()
    page = fmt.encode(k, v)
    assert page.shape == (3, 2, fmt.page_bytes) and page.dtype == torch.uint8
    assert torch.equal(page, fmt.encode(k, v))  # deterministic: equal prefixes give equal pages
    # one block's page does not depend on the other blocks compressed with it
    assert torch.equal(page[1:2], fmt.encode(k[1:2], v[1:2]))
    k2, v2 = fmt.decode(page)
    for x, y in ((k, k2), (v, v2)):
        error = ((y.float() - x.float()).norm() / x.float().norm()).item()
        assert 0 < error < 0.6, (text, error)
    assert fmt.bits_per_element() < 6


def test_pages_hold_what_gear_hf_compress_gives():
    """The page is gear_hf.compress's chunk, not a copy of it: decoding equals gear_hf's own decompress."""
    from gear_hf.compress import compress

    config = GearConfig.preset("gear-2")
    fmt = PageFormat(config, BS, D, torch.bfloat16)
    key_spec, value_spec = chunk_specs(config, BS, D)
    k, v = _blocks()
    k2, v2 = fmt.decode(fmt.encode(k, v))
    assert torch.equal(k2, decompress(compress(k, key_spec), key_spec, BS, D, torch.bfloat16))
    assert torch.equal(v2, decompress(compress(v, value_spec), value_spec, BS, D, torch.bfloat16))
    assert key_spec.axis == "channel" and key_spec.group == BS and value_spec.axis == "token"


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="GEAR_HF_VLLM_CONFIG"):
        config_from_env("{not json")
    with pytest.raises(ValueError, match="key_bits"):
        config_from_env('{"method": "kivi", "key_bits": 5, "key_bit_allocation": "uniform"}')
    with pytest.raises(ValueError, match="preset"):
        config_from_env('{"preset": "gear-7"}')


def _plan(book, lens, queries, table, bs=4):
    starts = torch.tensor([0, *torch.tensor(queries).cumsum(0).tolist()])
    return StepPlan.build(book, bs, starts, torch.tensor(lens), torch.tensor(table), int(starts[-1]))


def test_plan_prefill_then_decode_moves_blocks_from_tails_to_pages():
    book = TailBook(slots=2)
    # request 0: 6-token prompt (blocks 7, 3), request 1: 3-token prompt (block 5)
    plan = _plan(book, lens=[6, 3], queries=[6, 3], table=[[7, 3], [5, 0]])
    assert plan.read_blocks.numel() == 0
    assert plan.stage_blocks.tolist() == [7, 3, 5] and plan.stage_closes.tolist() == [True, False, False]
    assert plan.stage_keep[0] == -1 and {plan.stage_keep[1].item(), plan.stage_keep[2].item()} == {0, 1}
    assert plan.token_offset.tolist() == [0, 1, 2, 3, 0, 1, 0, 1, 2]
    # decode: request 0 reads block 7's page, extends block 3 from its tail; request 1 fills block 5
    plan = _plan(book, lens=[7, 4], queries=[1, 1], table=[[7, 3], [5, 0]])
    assert plan.read_blocks.tolist() == [7]
    assert plan.stage_blocks.tolist() == [3, 5] and plan.stage_tail.tolist() != [-1, -1]
    assert plan.stage_closes.tolist() == [False, True] and book.held(5) is None
    assert plan.workspace_table.tolist() == [[0, 1], [2, 0]]
    part = plan.workspace_part([1])  # request 1 alone: block 5 (written), renumbered
    assert part.table.tolist() == [[0, 0]] and part.blocks == 1 and part.read.numel() == 0
    assert plan.stage_blocks[part.stage].tolist() == [5] and part.query_rows.tolist() == [1]


def test_plan_refuses_a_missing_tail():
    book = TailBook(slots=1)
    with pytest.raises(RuntimeError, match="should hold 2 tokens"):
        _plan(book, lens=[3], queries=[1], table=[[9]])


def test_tails_of_finished_requests_are_recycled_least_recently_used():
    book = TailBook(slots=2)
    _plan(book, lens=[2], queries=[2], table=[[1]])  # request A leaves block 1 open, then finishes
    _plan(book, lens=[2], queries=[2], table=[[2]])  # request B
    _plan(book, lens=[3, 2], queries=[1, 2], table=[[2], [4]])  # B decodes, C arrives: A's slot is recycled
    assert book.held(1) is None and book.held(2)[1] == 3 and book.held(4)[1] == 2
    with pytest.raises(RuntimeError, match="exhausted"):  # three open blocks in one step, two slots
        _plan(book, lens=[1, 1, 1], queries=[1, 1, 1], table=[[6], [7], [8]])


def test_plan_reads_a_cached_block_whose_last_token_is_recomputed():
    """A whole prompt found in the prefix cache: vLLM recomputes its last token; the block is read as its page."""
    book = TailBook(slots=2)
    _plan(book, lens=[4], queries=[4], table=[[3]])  # request A closes block 3 (bs=4)
    plan = _plan(book, lens=[4], queries=[1], table=[[3]])  # request B: same prompt, cached, last token recomputed
    assert plan.read_blocks.tolist() == [3] and plan.stage_blocks.numel() == 0 and plan.token_rows.numel() == 0
    fresh = TailBook(slots=2)  # a block this backend never closed is no page: refused, not read
    with pytest.raises(RuntimeError, match="should hold 3 tokens"):
        _plan(fresh, lens=[4], queries=[1], table=[[3]])


def test_sink_slots_follow_first_blocks_until_they_are_written_again():
    """A request's block 0 gets a sink slot when it closes; requests reading that page (prefix caching too) get the
    slot; the slot is freed when the block is written again, and reused."""
    book = TailBook(slots=4, sink_tokens=2)
    plan = _plan(book, lens=[6, 3], queries=[6, 3], table=[[7, 3], [5, 0]])  # (bs=4) block 7 closes: request 0's
    assert plan.stage_sink.tolist() == [0, -1, -1] and plan.sink_slots == 1 and plan.sink_slot.tolist() == [-1, -1]
    plan = _plan(book, lens=[7, 4], queries=[1, 1], table=[[7, 3], [5, 0]])  # block 5 (request 1's block 0) closes
    assert plan.sink_slot.tolist() == [0, -1] and plan.read_sink.tolist() == [0]
    assert plan.stage_sink.tolist() == [-1, 1] and plan.sink_slots == 2
    plan = _plan(book, lens=[5, 3], queries=[1, 3], table=[[7, 2], [5, 9]])  # block 5 reused by a new prompt
    assert plan.sink_slot.tolist() == [0, -1] and 5 not in book.sinks
    plan = _plan(book, lens=[4], queries=[4], table=[[8]])  # a new first block takes the freed slot
    assert plan.stage_sink.tolist() == [1] and plan.sink_slots == 2
    none = TailBook(slots=2)  # no sinks: nothing assigned
    assert _plan(none, lens=[4], queries=[4], table=[[8]]).stage_sink.tolist() == [-1]


@pytest.mark.parametrize("text", ['{"preset": "gear-2"}', '{"preset": "kivi-2", "value_axis": "channel"}',
                                  '{"preset": "gear-2", "rotation": "values", "range_search": "keys"}'])
def test_transformers_config_stores_the_plugins_pages(text):
    """gear_hf's Transformers path under `transformers_config` stores what the plugin stores: no prompt chunk, the
    prompt and the generated tokens in decode chunks of one block each, from token 0 (aligned with vLLM's blocks),
    each compressed as the page of that block; the open block stays exact. (Not for key_bit_allocation="query":
    there the Transformers path chooses key widths from the queries, the plugin from each block's key ranges.)"""
    from transformers import LlamaConfig

    from gear_hf.cache import GearCache
    from gear_hf.vllm.format import transformers_config
    from reference_match import assert_matches_oracle

    config = config_from_env(text)
    prompt, steps, heads, bs = 23, 30, 2, 16  # 53 tokens: blocks 0-2 closed (prompt ones among them), 5 open
    hf_config = transformers_config(config, bs, D, longest_prompt=prompt)
    assert hf_config.prompt_group_size > prompt and hf_config.sink_tokens == 0 and hf_config.buffer_size == bs
    model_config = LlamaConfig(num_hidden_layers=1, hidden_size=heads * D, num_attention_heads=heads,
                               num_key_value_heads=heads)
    cache = GearCache(model_config, hf_config.replace(backend="torch"))
    g = torch.Generator().manual_seed(1)
    K, V = (torch.randn(1, heads, prompt + steps, D, generator=g) for _ in range(2))
    K[..., 3] *= 6
    out = cache.store_and_read(0, K[:, :, :prompt], V[:, :, :prompt])
    for t in range(prompt, prompt + steps):
        out = cache.store_and_read(0, K[:, :, t: t + 1], V[:, :, t: t + 1])
    closed = (prompt + steps) // bs
    assert cache.prefill_len == [0] and cache.decode_chunks == [closed]
    fmt = PageFormat(config, bs, D, torch.float32)
    blocks = [x[0, :, : closed * bs].reshape(heads, closed, bs, D).transpose(0, 1) for x in (K, V)]  # [N,H,bs,d]
    pages = fmt.decode(fmt.encode(*blocks))
    for x, got, page in zip((K, V), out, pages):
        expected = torch.cat([page.transpose(0, 1).reshape(1, heads, closed * bs, D), x[:, :, closed * bs:]], dim=2)
        assert_matches_oracle(got, expected, config.uses_lowrank or config.rotation != "none")


def test_transformers_config_refuses_formats_without_an_equivalent():
    from gear_hf.vllm.format import transformers_config

    with pytest.raises(ValueError, match="no equivalent"):
        transformers_config(GearConfig.preset("kcvt-4"), BS, D, longest_prompt=10)
    with pytest.raises(ValueError, match="no equivalent"):
        transformers_config(GearConfig.preset("kivi-2", key_axis="token"), BS, D, longest_prompt=10)
