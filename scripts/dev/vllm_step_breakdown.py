"""Where a vLLM engine step's attention time goes: `python -m gear_hf.vllm.run` (same arguments, run in this
process) with timers on the attention backend's entry points, microseconds per layer call, decode steps (at most 16
query tokens in the step) apart from prefill steps.

    OMP_NUM_THREADS=2 .venv-vllm/bin/python scripts/dev/vllm_step_breakdown.py --model DIR --prompts P.json \
        --max-tokens 128 --max-num-seqs 16 --warm-up --out /tmp/run.json [--gear '{}']

Without --gear: stock CPU_ATTN's forward alone. With it: the GEAR backend's forward and its parts (writing the step's
tokens, the paged kernel and the Python around it, the workspace path, compressing the blocks that closed). Only the
timed generate is counted (the second one with --warm-up). Timers add a few microseconds per call.
"""

from __future__ import annotations

import atexit
import collections
import functools
import sys
import time

DECODE_TOKENS = 16  # a step with at most this many query tokens counts as a decode step


def main(argv: list[str]) -> None:
    import vllm

    seconds, calls, step = collections.defaultdict(float), collections.Counter(), ["prefill"]
    generates = []
    order: list[str] = []

    def timer(function, label, sets_step=False):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            if sets_step:  # (forward: args are self, layer, query, key, value, kv_cache, attn_metadata, ...)
                metadata = args[6] if len(args) > 6 else kwargs.get("attn_metadata")
                step[0] = "decode" if metadata is not None and metadata.num_actual_tokens <= DECODE_TOKENS \
                    else "prefill"
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[(label, step[0])] += time.perf_counter() - start
                calls[(label, step[0])] += 1
        if label not in order:
            order.append(label)
        return timed

    def install() -> None:
        """The timers, once vLLM has loaded the backend (importing it earlier upsets vLLM's kernel registry)."""
        if "--gear" not in argv:
            from vllm.v1.attention.backends import cpu_attn

            impl = cpu_attn.CPUAttentionBackendImpl
            impl.forward = timer(impl.forward, "forward (CPU_ATTN)", sets_step=True)
            return
        from gear_hf.kernels.cpu import paged
        from gear_hf.vllm import backend
        from gear_hf.vllm import format as page_format

        impl = backend.GearAttentionImpl
        impl.forward = timer(impl.forward, "forward", sets_step=True)
        for name in ("_layer_pages", "_write", "_attend_pages", "_attend_workspace", "_store"):
            setattr(impl, name, timer(getattr(impl, name), f"  {name}"))
        paged.paged_attention = timer(paged.paged_attention, "    paged_attention (the kernel and its checks)")
        page_format.PageFormat.encode = timer(page_format.PageFormat.encode, "    PageFormat.encode")

    generate = vllm.LLM.generate

    def counted_generate(self, *args, **kwargs):
        generates.append(1)
        if len(generates) == (2 if "--warm-up" in argv else 1):
            install()
        return generate(self, *args, **kwargs)

    vllm.LLM.generate = counted_generate

    def report() -> None:
        for kind in ("decode", "prefill"):
            for label in order:
                if calls[(label, kind)]:
                    print(f"{kind:8s} {label:46s} {1e6 * seconds[(label, kind)] / calls[(label, kind)]:9.1f} us per "
                          f"call ({calls[(label, kind)]} calls, {seconds[(label, kind)]:.2f} s)")

    atexit.register(report)
    sys.argv = ["gear_hf.vllm.run", *argv]
    from gear_hf.vllm.run import main as run

    run()


if __name__ == "__main__":
    main(sys.argv[1:])
