"""Speculative decoding (assisted generation, prompt lookup) with a GEAR cache: generate builds a speculative
GearCache (a decode step's own tokens stay buffered until the next step), transformers crops what verification
rejected, and a crop that would reach into compressed chunks raises a ValueError that says so."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import gear_hf
from tiny_models import tiny_model

# a prompt that repeats itself: prompt lookup finds n-grams to draft from, and the tiny model's continuation too
PROMPT = torch.tensor([[5, 9, 17, 33, 5, 9, 17, 33, 5, 9, 17, 40, 41, 5, 9, 17, 33, 5, 9, 17, 60, 5, 9, 17, 33]])
COMPRESSING = gear_hf.GearConfig.preset("kivi", bits=4, buffer_size=8, group_size=8)


def _greedy(model, steps: int = 24, **kwargs) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(input_ids=PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=steps,
                              min_new_tokens=steps, do_sample=False, pad_token_id=0, **kwargs)


@pytest.fixture(scope="module")
def models():
    model = tiny_model("llama3")
    assistant = tiny_model("llama3", layers=1)
    return model, assistant


@pytest.mark.parametrize("how", ["prompt_lookup", "assistant"])
def test_fp16_preset_equals_stock_with_speculation(models, how):
    model, assistant = copy.deepcopy(models[0]), models[1]
    kwargs = {"prompt_lookup_num_tokens": 3} if how == "prompt_lookup" else {"assistant_model": assistant}
    stock = _greedy(model, **kwargs)
    with gear_hf.enabled(model, gear_hf.GearConfig.preset("fp16")):
        out = _greedy(model, **kwargs)
        cache = gear_hf.last_cache(model)
    assert isinstance(cache, gear_hf.GearCache) and cache.speculative
    assert torch.equal(stock, out)


# values held a chunk longer than keys (value_buffer_size): crops reach the value buffer past its held chunk
HELD = COMPRESSING.replace(value_buffer="int8", value_buffer_size=16)
HELD_KEYS = HELD.replace(key_buffer="int8", key_buffer_size=16)  # (keys too: both buffers start with the held chunk)
# both held until 4 tokens are buffered after the chunk: crops reach rows that released it and rows that hold it
RELEASED_EARLY = HELD_KEYS.replace(held_for=0.5)


@pytest.mark.parametrize("config", [COMPRESSING, HELD, HELD_KEYS, RELEASED_EARLY],
                         ids=["kivi-4", "values-held", "keys-held", "released-early"])
@pytest.mark.parametrize("how", ["prompt_lookup", "assistant"])
def test_compressed_cache_verifies_and_crops(models, how, config, monkeypatch):
    """A compressing config: drafted tokens are verified in multi-token steps, the rejected ones cropped (counted
    here), decode chunks flushed, and the result is the config's own greedy output."""
    model, assistant = copy.deepcopy(models[0]), copy.deepcopy(models[1])
    crops = []
    original = gear_hf.GearCache.crop

    def counting(self, tokens_to_remove):
        crops.append(tokens_to_remove)
        return original(self, tokens_to_remove)

    monkeypatch.setattr(gear_hf.GearCache, "crop", counting)
    kwargs = {"prompt_lookup_num_tokens": 3} if how == "prompt_lookup" else {"assistant_model": assistant}
    if how == "assistant":  # an enabled draft model keeps transformers' cache (and says so once)
        gear_hf.enable(assistant, COMPRESSING)
    with gear_hf.enabled(model, config):
        plain = _greedy(model)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            speculated = _greedy(model, **kwargs)
        cache = gear_hf.last_cache(model)
    assert cache.speculative and max(cache.decode_chunks) > 0
    assert any(c < 0 for c in crops), crops  # something was rejected and taken back
    assert cache.get_seq_length() == speculated.shape[1] - 1
    assert torch.equal(plain, speculated)
    drafts = [w for w in seen if "drafts for another" in str(w.message)]
    assert len(drafts) == (1 if how == "assistant" else 0)


@pytest.mark.parametrize("config", [COMPRESSING, gear_hf.GearConfig(group_size=8, buffer_size=8, prompt_group_size=16),
                                    gear_hf.GearConfig(group_size=8, buffer_size=8, prompt_group_size=16,
                                                       value_buffer_size=16)],
                         ids=["kivi-4", "default", "values-held"])
def test_drafts_of_the_first_step_are_not_compressed_with_the_prompt(models, config):
    """The first verifying step holds the prompt and the first drafted tokens together: 25 + 7 tokens filled whole
    chunks, the drafts were compressed with the prompt, and cropping the rejected ones raised mid-generate (as
    GearConfig() did on a 385-token prompt with prompt_lookup_num_tokens=10). Up to a buffer's worth of that step's
    newest tokens now stay uncompressed."""
    model = copy.deepcopy(models[0])
    with gear_hf.enabled(model, config):
        plain = _greedy(model)
        speculated = _greedy(model, prompt_lookup_num_tokens=7)
        cache = gear_hf.last_cache(model)
    assert cache.speculative and max(cache.decode_chunks) > 0
    if config is COMPRESSING:  # (groups of 8 tokens whichever chunk holds them: the same codes as plain greedy)
        assert torch.equal(plain, speculated)


def test_drafts_in_the_sink_of_a_short_prompt_are_taken_back(models):
    """A prompt shorter than sink_tokens: the first step's drafts fill the sink, and crop raised on a rejected one
    ("holds only its newest 0 uncompressed", GearConfig() with a 1-3 token prompt and an assistant). A row with
    nothing compressed gives back sink tokens too; the output is plain greedy's."""
    model, assistant = copy.deepcopy(models[0]), models[1]
    config = COMPRESSING.replace(sink_tokens=4)
    prompt = PROMPT[:, :2]
    with gear_hf.enabled(model, config), torch.inference_mode():
        outs = [model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20,
                               min_new_tokens=20, do_sample=False, pad_token_id=0, **kwargs)
                for kwargs in ({}, {"assistant_model": assistant})]
        cache = gear_hf.last_cache(model)
    assert cache.speculative and max(cache.decode_chunks) > 0
    assert torch.equal(outs[0], outs[1])


def test_crop_into_compressed_chunks_raises_clearly(models):
    model = copy.deepcopy(models[0])
    gear_hf.enable(model, COMPRESSING)
    cache = gear_hf.GearCache(model)  # not speculative: a step's tokens are compressed as soon as a chunk fills
    assert not cache.is_croppable
    with torch.inference_mode():
        model(input_ids=PROMPT, cache=cache, use_cache=True)
        for token in range(7, 40):  # until a step's own token is compressed with its chunk
            model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
            if cache.buffer_len == [0] and max(cache.decode_chunks) > 0:
                break
    assert cache.buffer_len == [0] and max(cache.decode_chunks) > 0
    with pytest.raises(ValueError, match=r"cannot crop 1 tokens: row 0 .*speculative=True"):
        cache.crop(-1)
    with pytest.raises(ValueError, match=r"cannot crop 3 tokens: only the last step's 1"):
        cache.crop(-3)
    length = cache.get_seq_length()
    cache.crop(0)
    cache.crop(length + 5)  # (the older convention: keep the first m; more than held is a no-op)
    assert cache.get_seq_length() == length


def test_early_exit_self_speculation_keeps_the_verifiers_gear_cache(models):
    """assistant_early_exit: the model drafts with its own first layers inside its own generate. That nested draft
    call keeps transformers' cache (and says so once), but last_cache() is still the verifying call's GearCache (it
    was once reset to None by the nested draft call), and the tokens are the config's greedy output."""
    model = copy.deepcopy(models[0])
    with gear_hf.enabled(model, COMPRESSING):
        plain = _greedy(model)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            speculated = _greedy(model, assistant_early_exit=1)
        cache = gear_hf.last_cache(model)
    assert isinstance(cache, gear_hf.GearCache) and cache.speculative
    assert cache.get_seq_length() == speculated.shape[1] - 1 and max(cache.decode_chunks) > 0
    assert torch.equal(plain, speculated)
    drafts = [str(w.message) for w in seen if "gear_hf" in str(w.message)]
    assert len(drafts) == 1 and "assistant_early_exit" in drafts[0], drafts
