"""`--model_args` of the gear_hf lm-eval model, and the CLI's argument handling (no model is run here)."""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")

from gear_hf import GearConfig  # noqa: E402
from gear_hf.lm_eval import cli, sharding  # noqa: E402
from gear_hf.lm_eval.args import ModelArgsError, config_name, gear_keys, parse_gear_args, split_model_args  # noqa: E402


def test_every_gearconfig_field_is_a_key():
    import dataclasses

    from gear_hf.config import Advanced

    keys = set(gear_keys())
    for f in (*dataclasses.fields(GearConfig), *dataclasses.fields(Advanced)):
        assert f.name == "advanced" or f.name in keys or f"gear_{f.name}" in keys
    assert {"preset", "bits"} <= keys


def test_preset_bits_and_fields():
    config, rest = split_model_args({"pretrained": "/m", "preset": "gear", "bits": 2, "buffer_size": 128,
                                     "dtype": "float32", "gguf_file": "x.gguf"})
    assert config == GearConfig.preset("gear", bits=2, buffer_size=128)
    assert rest == {"pretrained": "/m", "dtype": "float32", "gguf_file": "x.gguf"}


def test_strings_are_converted():
    """The Python API / create_from_arg_string may hand over strings; lm-eval's CLI hands typed values."""
    config = parse_gear_args({"preset": "outlier", "bits": "4", "outlier_ratio": "0.05", "pre_rope": "false",
                              "group_size": "32", "buffer_size": "64", "key_axis": "token"})
    assert config == GearConfig.preset("outlier", bits=4, outlier_ratio=0.05, pre_rope=False, group_size=32,
                                       buffer_size=64, key_axis="token")
    assert parse_gear_args({"preset": "kivi", "pre_rope": True, "outlier_ratio": 0}).pre_rope is True
    assert parse_gear_args({"method": "kivi", "key_bits": 2, "value_bits": 4}).describe() == "kivi-k2v4"


def test_numeric_string_fields_from_the_cli():
    """lm-eval's CLI parses value_statistics=8 (the field's values are "16" and "8") into the int 8, which was
    refused ("allowed: a string"): the option could not be set from the command line."""
    from lm_eval.utils import simple_parse_args_string

    args = simple_parse_args_string("pretrained=/m,value_statistics=8,key_buffer=int4,value_buffer=int8")
    config, _ = split_model_args(args)
    assert config == GearConfig(value_statistics="8", key_buffer="int4", value_buffer="int8")
    with pytest.raises(ModelArgsError, match=r"value_statistics='4' is invalid; allowed: '16' \| '8'"):
        split_model_args(simple_parse_args_string("pretrained=/m,value_statistics=4"))


def test_optional_integer_fields_from_strings_and_the_cli():
    """Fields that are None or an integer (key_group_size, prompt_group_size): "None" and numbers as strings, as the
    Python API or lm-eval's CLI may hand them, become None and ints; anything else names the key."""
    from lm_eval.utils import simple_parse_args_string

    args = simple_parse_args_string("pretrained=/m,group_size=64,buffer_size=64,prompt_group_size=128,"
                                    "key_group_size=None")
    config, _ = split_model_args(args)
    assert config == GearConfig(group_size=64, buffer_size=64, prompt_group_size=128)
    assert parse_gear_args({"group_size": "64", "buffer_size": "64", "prompt_group_size": "128",
                            "key_group_size": "none"}) == config
    with pytest.raises(ModelArgsError, match=r"prompt_group_size='twice' is invalid; allowed: an integer"):
        parse_gear_args({"prompt_group_size": "twice"})


def test_held_for_from_strings_and_the_cli():
    """held_for: a number, as lm-eval's CLI hands it (a string); anything else names the key."""
    from lm_eval.utils import simple_parse_args_string

    config, _ = split_model_args(simple_parse_args_string("pretrained=/m,held_for=0.5"))
    assert config == GearConfig(held_for=0.5) and config.held_for == 0.5
    assert parse_gear_args({"held_for": "0.25"}) == GearConfig(held_for=0.25)
    with pytest.raises(ModelArgsError, match=r"held_for='soon' is invalid; allowed: a number"):
        parse_gear_args({"held_for": "soon"})


def test_defaults_and_method_alias():
    assert parse_gear_args({}) == GearConfig()
    assert parse_gear_args({"method": "fp16"}).method == "fp16"
    with pytest.raises(ModelArgsError, match="disagree"):
        parse_gear_args({"preset": "gear", "method": "kivi"})


def test_recommended_names():
    """A frontier pick by name (GearConfig.recommended), fields changed on top; not together with a preset."""
    assert parse_gear_args({"recommended": "smallest"}) == GearConfig.recommended(name="smallest")
    assert parse_gear_args({"recommended": "balanced", "sink_tokens": "0"}) == \
        GearConfig.recommended(name="balanced", sink_tokens=0)
    with pytest.raises(ModelArgsError, match="recommended='tiny' is invalid; allowed: smallest \\| balanced"):
        parse_gear_args({"recommended": "tiny"})
    with pytest.raises(ModelArgsError, match="not both"):
        parse_gear_args({"recommended": "small", "preset": "gear-2"})


@pytest.mark.parametrize("args, name", [
    ({"recommended": "smallest"}, "recommended=smallest"),
    ({"recommended": " smallest ", "buffer_size": 256}, "recommended=smallest"),
    ({}, "default"),
    ({"buffer_size": 256}, "default"),
    ({"preset": "gear-2"}, None),  # named by GearConfig.describe()
    ({"method": "kivi", "bits": 4}, None),
])
def test_config_name_is_how_the_args_named_it(args, name):
    """Recorded as gear_name in the results (recommended=smallest is more than kivi-2-query-allocated)."""
    assert config_name({"pretrained": "/m", **args}) == name


def test_preset_names_with_bits():
    """The names the README, demo and sweep print are accepted as model_args."""
    assert parse_gear_args({"preset": "gear-2"}) == GearConfig.preset("gear", bits=2)
    assert parse_gear_args({"preset": "kivi-k4v2"}).describe() == "kivi-k4v2"


def test_pretrained_stays_a_string():
    _, rest = split_model_args({"pretrained": 123, "tokenizer": 7})
    assert rest["pretrained"] == "123" and rest["tokenizer"] == "7"


@pytest.mark.parametrize("args, match", [
    ({"preset": "gearx"}, r"preset='gearx' is invalid \(did you mean 'gear'.*METHOD one of fp16 \| kivi"),
    ({"preset": "gear2"}, r"preset='gear2' is invalid \(did you mean 'gear-2', i.e. preset='gear', bits=2\)"),
    ({"bits": 5}, r"^gear_hf --model_args: bits=5 is invalid; allowed: 2, 3, 4, 8 \(sets key_bits and value_bits\)$"),
    ({"preset": "gear", "bits": 5}, r"^gear_hf --model_args: bits=5 is invalid; allowed: 2, 3, 4, 8 "),
    ({"bits": "two"}, r"bits='two' is invalid; allowed: an integer"),
    ({"bits": True}, r"bits=True is invalid; allowed: an integer"),
    ({"outlier_ratio": "abc"}, r"outlier_ratio='abc' is invalid; allowed: a number"),
    ({"pre_rope": "maybe"}, r"pre_rope='maybe' is invalid; allowed: true or false"),
    ({"buffer_size": 100}, r"buffer_size=100 is invalid; allowed: a multiple of 8 \(keys are grouped along tokens"),
    ({"buffer_size": 200}, r"buffer_size=200 is invalid; allowed: a positive multiple of 128 \(the groups along"),
    ({"key_axis": "row"}, r"key_axis='row' is invalid; allowed: channel \| token"),
    ({"bits": 2, "key_bits": 4}, r"give bits, or key_bits/value_bits, not both"),
    ({"gear_backend": "cuda"}, r"gear_backend='cuda' is invalid; allowed: auto \| torch \| triton \| numba"),
])
def test_bad_values_name_key_value_and_allowed(args, match):
    with pytest.raises(ModelArgsError, match=match):
        split_model_args({"pretrained": "/m", **args})


def test_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(ModelArgsError) as err:
        split_model_args({"pretrained": "/m", "buffersize": 64})
    message = str(err.value)
    assert "unknown key 'buffersize'" in message and "did you mean 'buffer_size'" in message
    assert "GEAR keys: preset, recommended, bits" in message and "gguf_file" in message


def test_hf_keys_pass_through():
    _, rest = split_model_args({"pretrained": "/m", "attn_implementation": "eager", "max_length": 2048,
                                "batch_size": 4, "device": "cpu", "trust_remote_code": False})
    assert rest["attn_implementation"] == "eager" and rest["max_length"] == 2048


def test_backend_collision():
    """GearConfig.backend is `gear_backend=`; `backend=` stays lm-eval's causal/seq2seq switch."""
    config, rest = split_model_args({"pretrained": "/m", "gear_backend": "torch", "backend": "causal"})
    assert config.backend == "torch" and rest["backend"] == "causal"
    with pytest.raises(ModelArgsError, match="write gear_backend=triton"):
        split_model_args({"pretrained": "/m", "backend": "triton"})


def test_model_rejects_bad_args_before_loading():
    """Errors come before any weights load (the path does not even exist)."""
    from gear_hf.lm_eval.model import GearHFLM

    with pytest.raises(ModelArgsError, match=" bits=5 is invalid"):
        GearHFLM(pretrained="/does/not/exist", preset="gear", bits=5)
    with pytest.raises(ModelArgsError, match="unknown key 'rank'"):
        GearHFLM(pretrained="/does/not/exist", rank=4)
    with pytest.raises(ModelArgsError, match="pretrained"):
        GearHFLM()


def test_model_is_registered():
    from lm_eval.api.registry import get_model

    cli.register()
    from gear_hf.lm_eval.model import GearHFLM

    assert get_model("gear_hf") is GearHFLM


# CLI argument handling ------------------------------------------------------------------------------------------
def test_task_dir_holds_the_tasks():
    root = cli.task_dir()
    assert (root / "gsm8k" / "gsm8k_cot_gear.yaml").is_file()
    assert (root / "aqua" / "aqua_cot_gear.yaml").is_file()
    assert len(list((root / "bbh").glob("bbh_cot_gear_*.yaml"))) == 27


@pytest.mark.parametrize("argv, added", [
    (["--model", "gear_hf", "--tasks", "gsm8k_cot_gear"], True),        # legacy form (no subcommand)
    (["run", "--model", "gear_hf", "--tasks", "x"], True),
    (["ls", "tasks"], True),
    (["validate", "--tasks", "gsm8k_cot_gear"], True),
    (["--model", "gear_hf", "--include_path", "/mine", "--tasks", "x"], False),
    (["--model", "gear_hf", "--include_path=/mine", "--tasks", "x"], False),
    (["--help"], False),
    ([], False),
])
def test_include_path_added_unless_given(argv, added):
    out = cli.with_task_dir(argv)
    assert out[: len(argv)] == argv  # everything else is handed over unchanged
    assert (out[len(argv):] == ["--include_path", str(cli.task_dir())]) == added


def test_include_path_from_config_yaml_is_respected(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("include_path: /mine\nmodel: gear_hf\n")
    assert "--include_path" not in cli.with_task_dir(["run", "--config", str(cfg), "--tasks", "x"])
    cfg.write_text("model: gear_hf\n")
    assert "--include_path" in cli.with_task_dir(["run", "--config", str(cfg), "--tasks", "x"])


def test_cpu_process_group_only_when_launched_multi_process(monkeypatch):
    import os

    import torch

    monkeypatch.setenv("ACCELERATE_USE_CPU", "")  # restored (removed) at teardown
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    sharding.prepare_process_group()
    assert os.environ["ACCELERATE_USE_CPU"] == ""
    monkeypatch.setenv("WORLD_SIZE", "2")
    sharding.prepare_process_group()
    assert os.environ.get("ACCELERATE_USE_CPU") == (None if torch.cuda.is_available() else "true")
