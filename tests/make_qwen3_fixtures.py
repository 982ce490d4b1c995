"""Builds the tiny random Qwen3 checkpoints in tests/fixtures/ with Hugging Face `transformers`.

Not run by the tests (CI has no torch): run it by hand when the fixtures must change,

    python -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers tokenizers
    /tmp/hf/bin/python tests/make_qwen3_fixtures.py

and commit tests/fixtures/. Each fixture directory holds a Qwen3 checkpoint as
`save_pretrained` writes it, a `tokenizer.json`, and `reference.npz` with a fixed
input and the logits `transformers` computes for it (float32, eager attention).

- `qwen3_tiny`: tied embeddings, float32, one `model.safetensors`.
- `qwen3_tiny_sharded`: untied LM head, bfloat16, sharded safetensors with an index.

Both use head_dim 24 with d_model 64 and 4 heads (head_dim != d_model / n_heads, as in
real Qwen3), 3 layers, grouped-query attention (2 kv heads), and norm gains drawn around
1 so that a misplaced norm shows up in the logits.
"""

from __future__ import annotations

import gzip
import os

import numpy as np
import tokenizers
import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "deltares", "data", "assets", "mobydick.txt.gz")
VOCAB = 320


def build_tokenizer(out_dir: str) -> tokenizers.Tokenizer:
    """A byte-level BPE of 320 tokens trained on the first 200 KB of Moby-Dick."""
    with gzip.open(CORPUS, "rt", encoding="utf-8") as f:
        text = f.read(200_000)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text], trainer)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    return tok


def build(name: str, tied: bool, dtype: torch.dtype, shard_size: str | None, seed: int) -> None:
    out_dir = os.path.join(HERE, "fixtures", name)
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=tied,
        initializer_range=0.1,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
    model = model.to(dtype)
    model.save_pretrained(out_dir, max_shard_size=shard_size or "1GB", safe_serialization=True)
    build_tokenizer(out_dir)

    rng = np.random.default_rng(seed)
    input_ids = rng.integers(0, VOCAB, size=(2, 12), dtype=np.int64)
    # The reference reloads what was saved, in float32 (casting the bf16 model back would
    # also keep its rotary frequencies rounded to bf16).
    reference = transformers.Qwen3ForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = reference(torch.from_numpy(input_ids)).logits.float().numpy()
    np.savez(os.path.join(out_dir, "reference.npz"), input_ids=input_ids.astype(np.int32), logits=logits)
    print(f"{out_dir}: {sorted(os.listdir(out_dir))}, logits std {logits.std():.3f}")


if __name__ == "__main__":
    build("qwen3_tiny", tied=True, dtype=torch.float32, shard_size=None, seed=0)
    build("qwen3_tiny_sharded", tied=False, dtype=torch.bfloat16, shard_size="40KB", seed=1)
