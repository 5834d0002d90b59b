"""The user's path through the Python API: no silent fallback to a stock cache, GEAR asked for the
transformers way (`cache_implementation="gear"`), deep copies, config errors at construction or at `enable`."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import DynamicCache

import gear_hf
from tiny_models import CACHE_ARG, greedy, prompts, tiny_model

pytestmark = pytest.mark.compat

SMALL = dict(group_size=8, buffer_size=8)


def _enabled_model(arch: str = "llama2"):
    model = tiny_model(arch)
    gear_hf.enable(model, gear_hf.GearConfig.preset("gear", bits=2, **SMALL))
    return model


@pytest.mark.parametrize("call", [
    {"cache_implementation": "static"},
    {"cache_implementation": "dynamic"},
    {"use_cache": False},
    {CACHE_ARG: "dynamic-cache"},
])
def test_generate_without_gear_warns_once_and_last_cache_is_none(call):
    model = _enabled_model()
    ids, mask = prompts(1)
    greedy(model, ids, mask, 3)
    assert gear_hf.last_cache(model) is not None
    kwargs = {k: (DynamicCache(config=model.config) if v == "dynamic-cache" else v) for k, v in call.items()}
    with pytest.warns(UserWarning, match="not GEAR|GEAR is not used") as record:
        greedy(model, ids, mask, 3, **kwargs)
    assert len([w for w in record if "gear_hf" in str(w.message)]) == 1
    assert gear_hf.last_cache(model) is None  # not the previous call's cache
    if CACHE_ARG in kwargs:
        kwargs[CACHE_ARG] = DynamicCache(config=model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason again: no second warning
        greedy(model, ids, mask, 3, **kwargs)
    greedy(model, ids, mask, 3)
    assert gear_hf.last_cache(model) is not None  # a plain call uses GEAR again


def test_generation_config_cache_implementation_also_warns():
    model = _enabled_model()
    model.generation_config.cache_implementation = "static"
    ids, mask = prompts(1)
    with pytest.warns(UserWarning, match="cache_implementation='static'"):
        greedy(model, ids, mask, 2)
    assert gear_hf.last_cache(model) is None


def test_caller_gear_cache_is_the_last_cache():
    model = _enabled_model()
    ids, mask = prompts(1)
    cache = gear_hf.GearCache(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        greedy(model, ids, mask, 3, **{CACHE_ARG: cache})
    assert gear_hf.last_cache(model) is cache


@pytest.mark.parametrize("cache_layers", [1, 3])
def test_a_gear_cache_built_for_another_model_is_a_clear_error(cache_layers):
    """A GearCache built from a model with other layers than the one generating: a ValueError that says so (it was
    an IndexError with more model layers; with fewer, silently a cache whose last layer never stored, its steps never
    ended and its memory report counted a layer of nothing)."""
    model = _enabled_model()
    ids, mask = prompts(1)
    cache = gear_hf.GearCache(tiny_model("llama2", layers=cache_layers))
    with pytest.raises(ValueError, match=r"GearCache belongs to the model it was built from"):
        greedy(model, ids, mask, 3, **{CACHE_ARG: cache})


def test_cache_implementation_gear_with_cache_config():
    model = _enabled_model()
    ids, mask = prompts(2)
    plain_tokens, _ = greedy(model, ids, mask, 4)
    kivi = gear_hf.GearConfig.preset("kivi", bits=4, **SMALL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tokens, _ = greedy(model, ids, mask, 4, cache_implementation="gear",
                           cache_config={"preset": "kivi-4", **SMALL})
    assert gear_hf.last_cache(model).gear_config == kivi
    assert gear_hf.last_cache(model).get_seq_length() > ids.shape[1]
    greedy(model, ids, mask, 4, cache_implementation="gear", cache_config={"bits": 4})  # the enabled config, 4 bits
    assert gear_hf.last_cache(model).gear_config == gear_hf.GearConfig.preset("gear", bits=4, **SMALL)
    same, _ = greedy(model, ids, mask, 4, cache_implementation="gear")  # no cache_config: the enabled config
    assert torch.equal(same, plain_tokens)
    model.generation_config.cache_implementation = "gear"  # set on the model's generation config
    greedy(model, ids, mask, 2)
    assert gear_hf.last_cache(model).gear_config.key_bits == 2
    with pytest.raises(ValueError, match="rank"):
        greedy(model, ids, mask, 2, cache_implementation="gear", cache_config={"rank": 3})
    # a recommendation by name, as lm-eval's --model_args take it
    greedy(model, ids, mask, 2, cache_implementation="gear", cache_config={"recommended": "smallest", **SMALL})
    assert gear_hf.last_cache(model).gear_config == gear_hf.GearConfig.recommended("smallest", **SMALL)
    with pytest.raises(ValueError, match="recommended='smallest' names a whole configuration"):
        greedy(model, ids, mask, 2, cache_implementation="gear",
               cache_config={"recommended": "smallest", "preset": "gear-2"})


def test_cache_implementation_gear_on_a_model_not_enabled_says_to_enable():
    """transformers has no hook for cache names (GenerationConfig.validate checks a fixed tuple, 5.17
    and 5.24); gear_hf wraps that check to add the hint, and nothing else changes."""
    model = tiny_model("llama2")
    ids, mask = prompts(1)
    with pytest.raises(ValueError, match=r"Invalid `cache_implementation` \(gear\).*call gear_hf.enable\(model\)"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, cache_implementation="gear")
    with pytest.raises(ValueError, match=r"Invalid `cache_implementation` \(no-such-cache\)") as info:
        model.generate(ids, attention_mask=mask, max_new_tokens=2, cache_implementation="no-such-cache")
    assert "gear_hf" not in str(info.value)


@pytest.mark.parametrize("how", ["positional", "input_ids"])
def test_an_empty_prompt_is_a_clear_error(how):
    """0 prompt tokens failed inside the q/k/v projection ("cannot reshape tensor of 0 elements")."""
    model = _enabled_model()
    ids = torch.zeros(2, 0, dtype=torch.long)
    call = (ids,) if how == "positional" else ()
    kwargs = {} if how == "positional" else {"input_ids": ids}
    with pytest.raises(ValueError, match=r"empty prompt \(input_ids of shape \[2, 0\]: 0 tokens per row\)"):
        model.generate(*call, max_new_tokens=2, **kwargs)


def test_deepcopy_generates_with_the_copy():
    model = _enabled_model()
    ids, mask = prompts(1)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)  # the copy now computes something else
    mine, _ = greedy(model, ids, mask, 6)
    theirs, scores = greedy(twin, ids, mask, 6)
    assert gear_hf.is_enabled(twin) and gear_hf.last_cache(twin) is not None
    assert gear_hf.last_cache(twin) is not gear_hf.last_cache(model)
    gear_hf.disable(twin)
    stock, stock_scores = greedy(twin, ids, mask, 6)  # the copy's own weights, stock cache
    gear_hf.enable(twin, gear_hf.GearConfig.preset("fp16"))
    exact, exact_scores = greedy(twin, ids, mask, 6)  # fp16 through GEAR is exact: same as the copy's stock
    assert torch.equal(exact, stock)
    assert not torch.allclose(scores, greedy(model, ids, mask, 6)[1])  # the copy did not run the original


def test_reenable_checks_rope_every_time():
    model = tiny_model("llama2")
    model.model.rotary_emb.rope_type = "dynamic"
    gear_hf.enable(model, gear_hf.GearConfig(pre_rope=False))
    with pytest.raises(NotImplementedError, match="pre_rope=False"):
        gear_hf.enable(model, gear_hf.GearConfig(pre_rope=True))
    assert gear_hf.is_enabled(model) and model._gear_hf_state.config.pre_rope is False  # unchanged
    with pytest.raises(NotImplementedError, match="pre_rope=False"):
        with gear_hf.enabled(model, gear_hf.GearConfig()):
            pass
    gear_hf.disable(model)


def test_partial_model_is_refused_and_strict_is_gone():
    model = tiny_model("llama2", layers=2)
    del model.model.layers[1].self_attn.q_proj
    with pytest.raises(RuntimeError, match="every layer or none"):
        gear_hf.enable(model)
    with pytest.raises(TypeError):
        gear_hf.enable(model, strict=False)
    assert not gear_hf.is_enabled(model)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_triton_backend_without_cuda_fails_at_enable(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("GEAR_HF_BACKEND", raising=False)
    model = tiny_model("llama2", head_dim=32)  # (the fused kernel reads heads of 32 channels or more)
    gear_hf.enable(model, gear_hf.GearConfig())  # "auto" picks torch here: nothing to refuse
    gear_hf.disable(model)
    from gear_hf.backends import import_problem

    triton_available = import_problem("triton", "triton.language") is None
    reason = "it needs CUDA tensors" if triton_available else "triton is not installed"
    with pytest.raises(ValueError, match=f"backend='triton'.*{reason}"):
        gear_hf.enable(model, gear_hf.GearConfig(backend="triton"))
    assert not gear_hf.is_enabled(model)
    monkeypatch.setenv("GEAR_HF_BACKEND", "triton")
    with pytest.raises(ValueError, match=f"GEAR_HF_BACKEND=triton .*{reason}"):
        gear_hf.enable(model, gear_hf.GearConfig())
    monkeypatch.delenv("GEAR_HF_BACKEND")
    if triton_available:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the CPU interpreter (tests) is allowed
        gear_hf.enable(model, gear_hf.GearConfig(backend="triton"))
        gear_hf.disable(model)


# -- GearConfig: errors at construction, naming what the user wrote ------------------------------------------------

@pytest.mark.parametrize("kwargs,field,allowed", [
    (dict(group_size=7, buffer_size=7, key_bits=4, key_bit_allocation="uniform"), "group_size=7",
     "multiple of 2 (keys are grouped along tokens and 2 codes of 4 bits"),
    (dict(group_size=6, key_bits=2, buffer_size=12, key_bit_allocation="uniform"), "group_size=6",
     "multiple of 4 (keys are grouped along tokens and 4 codes of 2 bits"),
    (dict(group_size=12, buffer_size=12), "group_size=12", "multiple of 8 (keys are grouped along tokens and stored "
                                                         "as bit planes of 8 tokens"),
    (dict(group_size=48), "group_size=48", "divisor of buffer_size=64 (the default)"),
    (dict(value_axis="channel", value_group_size=256), "value_group_size=256", "divisor of buffer_size=64"),
    (dict(key_group_size=384, value_axis="channel", value_group_size=64), "key_group_size=384", "multiple of 384"),
    (dict(group_size=32, buffer_size=48), "buffer_size=48", "multiple of 32 (the groups along tokens"),
])
def test_config_errors_name_the_field_written(kwargs, field, allowed):
    with pytest.raises(ValueError) as err:
        gear_hf.GearConfig(**kwargs)
    assert f"GearConfig.{field} is invalid" in str(err.value) and allowed in str(err.value)


def test_packing_constraint_follows_the_packing_unit():
    from gear_hf.compress.quant import pack_unit

    for bits in (2, 3, 4, 8):
        good = pack_unit(bits)[0] * 3
        gear_hf.GearConfig(key_bits=bits, value_bits=bits, group_size=good, buffer_size=good,
                           key_bit_allocation="uniform")
    gear_hf.GearConfig(group_size=24, buffer_size=24, prompt_group_size=None)  # allocated keys: 8-token bit planes
    gear_hf.GearConfig(method="fp16", group_size=7, buffer_size=7)  # fp16 packs nothing


@pytest.mark.parametrize("name,method,bits", [
    ("gear-2", "gear", (2, 2)), ("kivi-4", "kivi", (4, 4)), ("gear-l-2", "gear-l", (2, 2)),
    ("gear-k4v2", "gear", (4, 2)), ("Gear-8", "gear", (8, 8)), ("fp16", "fp16", (4, 4)),
])
def test_preset_names_users_see(name, method, bits):
    config = gear_hf.GearConfig.preset(name)
    assert (config.method, config.key_bits, config.value_bits) == (method, *bits)
    assert gear_hf.GearConfig.preset(config.describe()) == config


@pytest.mark.parametrize("name,hint", [("gear2", "'gear-2', i.e. preset='gear', bits=2"),
                                       ("kivy-4", "'kivi-4'"), ("gear-l2", "'gear-l-2'")])
def test_preset_typos_get_a_did_you_mean(name, hint):
    with pytest.raises(ValueError, match="did you mean") as err:
        gear_hf.GearConfig.preset(name)
    assert hint in str(err.value)


def test_preset_bits_twice_must_agree():
    assert gear_hf.GearConfig.preset("gear-2", bits=2).key_bits == 2
    with pytest.raises(ValueError, match="already sets the bits"):
        gear_hf.GearConfig.preset("gear-2", bits=4)


# -- one place per concept ------------------------------------------------------------------------------------------

def _imported_modules(path) -> set[str]:
    """Modules `path` imports, and `from X import Y` also as X.Y (Y may be a module)."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names |= {base, *(f"{base}.{a.name}" for a in node.names)}
    return names


def test_no_library_module_imports_the_demo_and_one_gsm8k_loader():
    """The demo is an entry point, not a library; GSM8K files are read in gear_hf.gsm8k only."""
    from pathlib import Path

    package = Path(gear_hf.__file__).parent
    repo = package.parent
    sources = [p for p in [*package.rglob("*.py"), *(repo / "scripts").rglob("*.py")] if p.name != "demo.py"]
    for path in sources:
        assert not {n for n in _imported_modules(path) if "demo" in n.replace("..", ".").split(".")}, path
        if path.name != "gsm8k.py":
            text = path.read_text()
            assert '"train.jsonl"' not in text and "/ \"test.jsonl\").read_text" not in text, path
