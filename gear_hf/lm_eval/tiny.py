"""A tiny random causal LM with a real tokenizer, saved to a directory, for offline CLI tests and smoke runs.

The tokenizer is a byte-level BPE trained on the given texts (any text encodes, via bytes), wrapped as a
PreTrainedTokenizerFast; the model is a few-layer Llama/Mistral/Qwen2 with random weights. Greedy output is
meaningless but deterministic, which is all the tests need (same answers with 1 or 2 processes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

_BASE_TEXTS = (
    "Q: There are 3 boxes with 4 pens each. How many pens are there?\nA: 3 * 4 = 12. The answer is 12.",
    "Q: Which option is correct?\nAnswer Choices: (A) 1 (B) 2 (C) 3 (D) 4 (E) 5\nA: The answer is (B).",
    "A: Let's think step by step. So the answer is True. So the answer is No. So the answer is (C).",
    "The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 $ , . - + = ( ) ?",
)


def build_tiny_model(out_dir: str | Path, *, texts: Iterable[str] = (), model_type: str = "llama",
                     vocab_size: int = 1024, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                     num_kv_heads: int = 2, max_position_embeddings: int = 8192, initializer_range: float = 0.2,
                     seed: int = 0) -> Path:
    """Save a tiny random `model_type` (llama | mistral | qwen2) model and its tokenizer to `out_dir`."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([*_BASE_TEXTS, *texts], trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                     pad_token="<pad>")
    tokenizer.save_pretrained(out)

    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "qwen2": transformers.Qwen2Config}[model_type]
    config = config_cls(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                        num_hidden_layers=num_layers, num_attention_heads=num_heads,
                        num_key_value_heads=num_kv_heads, max_position_embeddings=max_position_embeddings,
                        initializer_range=initializer_range, tie_word_embeddings=False,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out)
    return out
