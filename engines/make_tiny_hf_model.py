"""Write a tiny random-weight Llama in Hugging Face format for a real vLLM on a CPU.

No hub access exists, so everything is made here, seeded, the same on every run:
- a byte-level BPE tokenizer (the `tokenizers` library) trained on seeded pseudo-words,
  vocabulary ~2k, special tokens <s> (BOS), </s> (EOS), <|im_start|>, <|im_end|>;
  encoding with special tokens prepends <s>, as Llama tokenizers do;
- a ChatML chat template (chat_template.jinja and tokenizer_config.json) that starts with the
  BOS token and renders system, user, assistant (with tool calls) and tool messages, and the
  assistant header when add_generation_prompt is set;
- a 4-layer Llama (hidden 256, GQA 4/2 heads) with seeded random bfloat16 weights.

Run with the vLLM venv's python (it has torch, transformers and tokenizers):
    python make_tiny_hf_model.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
ONSETS = "b c d f g h j k l m n p r s t v w z st tr pl kr"
VOWELS = "a e i o u ai ou"
ENGLISH = (
    "the of and to in is you that it was for on are as with they at be this have from or "
    "one had by word but not what all were we when your can said there use an each which "
    "system user assistant tool message question answer hello world please tell me about "
    "cache prefix request response token model engine gateway route json value true false"
)

# ChatML. Tool-call arguments arrive as a dict (vLLM parses the JSON string) or a string.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call.get('function') else call %}"
    "{{- '<tool_call>' + fn['name'] + ' ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}"
    "{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def training_corpus(seed: int, n_words: int = 3000, n_lines: int = 2000) -> list[str]:
    """Seeded pseudo-words plus plain English and punctuation, so real prompts tokenize sensibly."""
    rng = random.Random(seed)
    onsets = ONSETS.split()
    vowels = VOWELS.split()
    words = [
        "".join(rng.choice(onsets) + rng.choice(vowels) for _ in range(rng.randint(1, 3)))
        for _ in range(n_words)
    ]
    english = ENGLISH.split()
    punct = [".", ",", "?", "!", ":", ";", "\n", " -", " (", ")", '"', "'", "0", "1", "42"]
    lines = []
    for _ in range(n_lines):
        pool = english if rng.random() < 0.3 else words
        parts = [rng.choice(pool) for _ in range(rng.randint(20, 60))]
        lines.append(" ".join(parts) + rng.choice(punct))
    return lines


def build_tokenizer(seed: int, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(seed), trainer)
    bos_id = tok.token_to_id("<s>")
    # Llama-style: encode(add_special_tokens=True) prepends BOS; the chat template adds its own.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=4096, help="BPE target; the corpus gives ~2k")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(args.seed, args.vocab),
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=8192,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    # Some loaders read the template only from tokenizer_config.json, others only from the .jinja.
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["chat_template"] = CHAT_TEMPLATE
    tok_cfg["add_bos_token"] = True
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    print(f"wrote {out}: llama {args.layers} layers, hidden {args.hidden}, vocab {len(fast)}")


if __name__ == "__main__":
    main()
