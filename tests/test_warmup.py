"""`python -m gear_hf.warmup` compiles every CPU kernel a generate reaches, and `CompileWatch` sees what compiles:
after the warm-up, generates on other models (dtype, head_dim), lengths, batches and padding compile nothing."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("numba")

import gear_hf  # noqa: E402
from gear_hf.measure import warm_up  # noqa: E402
from gear_hf.warmup import SHIPPED, CompileWatch, main, shipped_config, tiny_model, warm_up_kernels  # noqa: E402


def test_the_watch_counts_a_compilation_and_not_a_call_of_compiled_code():
    import numba

    def add_two(x):
        return x + 2

    add_two.__module__ = "gear_hf.probe"  # (the watch counts gear_hf's kernels)
    kernel = numba.njit(add_two)
    with CompileWatch() as watch:
        assert kernel(1) == 3
    assert watch.compiled == ["test_the_watch_counts_a_compilation_and_not_a_call_of_compiled_code.<locals>.add_two"]
    assert watch.seconds > 0
    with CompileWatch() as again:
        assert kernel(2) == 4
    assert again.count == 0 and again.seconds == 0
    with CompileWatch() as other:
        assert kernel(2.5) == 4.5  # a new argument type: compiled again
    assert other.count == 1


def _generate(model, config, rows: int, prompt: int, new: int, context) -> None:
    ids = torch.randint(3, model.config.vocab_size, (rows, prompt), generator=torch.Generator().manual_seed(rows))
    mask = torch.ones_like(ids)
    for b in range(1, rows):
        mask[b, : 23 * b] = 0
    with gear_hf.enabled(model, config), context():
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=0)


@pytest.mark.parametrize("name", ["balanced", "gear-2"])
def test_after_the_warm_up_no_generate_compiles(name):
    """(Meaningful on a cold kernel cache, e.g. NUMBA_CACHE_DIR=$(mktemp -d): then only the warm-up compiles.)"""
    config = shipped_config(name)
    warm_up_kernels([name], report=lambda line: None)
    # (a 420-token prompt: a prompt chunk past 256 tokens, whose outlier indices take 16 bits)
    cases = [("bfloat16", 128, 3, 420, 2 * config.buffer_size + 9, torch.inference_mode),
             ("float32", 64, 1, 150, 70, torch.no_grad)]
    threads = torch.get_num_threads()
    try:
        for (dtype, head_dim, rows, prompt, new, context), count in zip(cases * 2, (1, 1, 2, 2)):
            torch.set_num_threads(count)  # (several threads take the parallel kernels: `kernels.cpu.threads`)
            model = tiny_model(dtype, head_dim=head_dim)
            with CompileWatch() as watch:
                _generate(model, config, rows, prompt, new, context)
            assert watch.count == 0, (dtype, head_dim, count, watch.compiled)
    finally:
        torch.set_num_threads(threads)


def test_the_demo_warm_up_reaches_what_a_padded_batch_uses():
    """`measure.warm_up` (one row, a short prompt: the demo's, lm-eval's) covers a longer left-padded batch."""
    config = gear_hf.GearConfig()
    model = tiny_model("float32")
    ids = torch.randint(3, 128, (1, 400), generator=torch.Generator().manual_seed(2))
    with gear_hf.enabled(model, config):
        warm = warm_up(model, ids, config, pad_token_id=0)
    assert warm.seconds >= warm.compile_seconds >= 0
    with CompileWatch() as watch:
        _generate(model, config, 4, 460, config.buffer_size + 40, torch.no_grad)
    assert watch.count == 0, watch.compiled


def test_the_command_reports_each_configuration(capsys):
    assert main(["--configs", "balanced", "--dtypes", "float32", "--jobs", "1"]) == 0
    out = capsys.readouterr().out  # (in this process: one line a configuration, for both thread counts)
    assert "balanced (float32): " in out and "kernel signature(s) compiled" in out and "cached in " in out
    assert SHIPPED[0] == "balanced" and "gear-2" in SHIPPED and "fp16" not in SHIPPED


@pytest.mark.parametrize("argv, message", [(["--configs", "gear-5"], "--configs 'gear-5'"),
                                           (["--dtypes", "float64"], "--dtypes 'float64' is invalid"),
                                           (["--jobs", "0"], "--jobs 0 is invalid")])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_worker_processes_leave_nothing_to_compile(capsys):
    """`--jobs 2`: the serial kernels compiled by one worker process (generates on one torch thread), the parallel
    ones by another (two threads), into the shared on-disk cache; a generate here, on either count, then compiles
    nothing (each worker's lines are reported, and the total)."""
    assert main(["--configs", "smallest,kivi-2", "--dtypes", "float32", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    for name in ("smallest", "kivi-2"):
        assert f"{name} (float32) on 1 torch thread(s): " in out and f"{name} (float32) on 2 torch thread(s): " in out
    assert "summed over 2 worker processes" in out
    model = tiny_model("float32")
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for name in ("smallest", "kivi-2"):
                with CompileWatch() as watch:
                    _generate(model, shipped_config(name), 2, 150, 70, torch.no_grad)
                assert watch.count == 0, (name, count, watch.compiled)
    finally:
        torch.set_num_threads(threads)


def test_without_numba_the_watch_counts_nothing(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "numba" else real(name, *a))
    with CompileWatch() as watch:
        types.SimpleNamespace()
    assert watch.count == 0 and watch._listener is None


def test_warm_ups_fit_the_model():
    from gear_hf.measure import warm_up_generates, warm_up_ids

    config = gear_hf.GearConfig()
    runs = warm_up_generates(config)
    assert len(runs) == 2 and runs[1][0] - config.sink_tokens - config.buffer_size > 256  # a wide prompt chunk
    assert warm_up_generates(config, max_positions=sum(runs[0])) == runs[:1]  # (the long one left out)
    assert warm_up_generates(None) == [(8, 2)]
    ids = torch.arange(10)[None]
    assert warm_up_ids(ids, 4).tolist() == [[6, 7, 8, 9]] and warm_up_ids(ids, 13)[0, :3].tolist() == [7, 8, 9]


def test_after_the_serving_warm_up_the_paged_attention_compiles_nothing(capsys):
    """`python -m gear_hf.warmup --serving` covers gear_hf.vllm's attention over pages of other shapes (block 128,
    head_dim 128, GQA 3:2, a decode and a prefill chunk), on one thread and two."""
    from test_cpu_paged import _case

    assert main(["--serving", "--configs", "balanced,gear-2", "--dtypes", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "balanced (bfloat16, vLLM pages) on 1 torch thread(s): " in out
    assert "balanced (bfloat16, vLLM pages) on 2 torch thread(s): " in out
    threads = torch.get_num_threads()
    try:
        for name in ("balanced", "gear-2"):
            for count in (1, 2):
                torch.set_num_threads(count)
                with CompileWatch() as watch:
                    _case(shipped_config(name), torch.bfloat16, rotated=True, bs=128, d=128, H=2, G=3,
                          lens=(300, 140), queries=(1, 9))
                assert watch.count == 0, (name, count, watch.compiled)
    finally:
        torch.set_num_threads(threads)
