"""GEAR in vLLM: an attention backend whose KV pages hold GEAR-compressed blocks (one vLLM block = one chunk).

Enabled per process by environment variables, read by the `vllm.general_plugins` entry point (`plugin.register`),
which vLLM runs in every process it starts:

    GEAR_HF_VLLM=1                                   replace CPU_ATTN's class with GearAttentionBackend (CPU) and
                                                     register GearTritonBackend as CUSTOM (GPUs:
                                                     --attention-backend CUSTOM)
    GEAR_HF_VLLM_CONFIG='{"preset": "gear-2"}'       the format: {"preset": NAME, ...GearConfig fields} or
                                                     {"recommended": NAME, ...} or plain GearConfig fields;
                                                     absent: GearConfig()

Nothing here is imported by the rest of gear_hf; it needs vllm (`make test-vllm` builds its environment).
"""
