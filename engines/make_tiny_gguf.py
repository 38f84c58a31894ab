"""Write a tiny random-weight Llama GGUF that llama.cpp's llama-server loads like a real model.

Seeded, so the file is byte-identical on every machine for the same arguments. Facts that shape it
(see /work/shared/engines/llamacpp/README.md and its make_tiny_gguf.py docstring):
- Vocabulary: SentencePiece-style ("llama"), the loader's simplest tokenizer. Ids 0..2 are
  <unk>, <s>, </s>; then all 256 byte-fallback tokens <0x00>..<0xFF> (the SPM tokenizer throws
  on a byte it cannot map); then the ChatML control tokens <|im_start|>, <|im_end|>; then normal
  pieces: "\u2581" (the SPM space), printable ASCII, and every prefix of each "\u2581word", so the
  SPM bigram merge can grow whole words (a longer piece scores higher, so it wins the merge).
- Logit shaping: embedding channel 0 holds a large constant, so after the final RMSNorm it is
  ~sqrt(n_embd) for every position, and column 0 of output.weight becomes a per-token logit bias.
  Control, byte and unknown tokens get a large negative bias (sampled text stays clean UTF-8 word
  pieces) and EOS / <|im_end|> a negative one, so generation runs to max_tokens.
- A ChatML template in tokenizer.chat_template makes /v1/chat/completions work.

Usage: python make_tiny_gguf.py --out tiny-llama.gguf [--vocab 8000 --layers 4 --embd 256]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import gguf
import numpy as np

SPM_SPACE = "\u2581"
# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_COMMON_WORDS_TEXT = """
a about after all also an and answer any are as assistant at back be because been but by cache
can client code could data day did do down engine error even first for from gateway get give go
good has have he hello her here him his how i if in into is it its just know latency like look
make me message model more most my new no not now of on one only or other our out over people
prefix prompt question request response route say see server she so some stream system take
tell than that the their them then there these they think this time to token tool two up us use
user value want way we well what when which who will with word work world would year you your
"""
COMMON_WORDS = _COMMON_WORDS_TEXT.split()


def build_vocab(size: int, seed: int) -> tuple[list[str], list[float], list[int]]:
    tokens: list[str] = ["<unk>", "<s>", "</s>"]
    types: list[int] = [UNKNOWN, CONTROL, CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    tokens += ["<|im_start|>", "<|im_end|>"]
    types += [CONTROL, CONTROL]

    seen = set(tokens)
    pieces: list[str] = []

    def add_word(word: str) -> None:
        full = SPM_SPACE + word
        for end in range(1, len(full) + 1):
            piece = full[:end]
            if piece not in seen:
                seen.add(piece)
                pieces.append(piece)

    for c in range(0x21, 0x7F):
        for piece in (chr(c), SPM_SPACE + chr(c)):
            if piece not in seen:
                seen.add(piece)
                pieces.append(piece)
    for w in COMMON_WORDS:
        add_word(w)
        add_word(w.capitalize())
    rng = random.Random(seed)
    consonants, vowels = "bdfgklmnprstvz", "aeiou"
    while len(tokens) + len(pieces) < size:
        n = rng.randint(2, 4)
        add_word("".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(n)))
    pieces = pieces[: size - len(tokens)]
    scores = [0.0] * len(tokens)
    # Longer pieces win SPM merges; a tiny rank term keeps scores distinct.
    scores += [float(len(p)) - i * 1e-6 for i, p in enumerate(pieces)]
    tokens += pieces
    types += [NORMAL] * len(pieces)
    return tokens, scores, types


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ff", type=int, default=704)
    ap.add_argument("--ctx", type=int, default=8192, help="llama.context_length (n_ctx_train)")
    ap.add_argument("--eos-bias", type=float, default=-30.0, help="-30: never stops early")
    args = ap.parse_args()

    tokens, scores, types = build_vocab(args.vocab, args.seed)
    rng = np.random.default_rng(args.seed)
    head_dim = args.embd // args.heads
    kv_dim = head_dim * args.kv_heads

    def matrix(rows: int, cols: int, std: float = 0.02) -> np.ndarray:
        # numpy (out, in); the writer stores dims reversed, as llama.cpp expects
        return (rng.standard_normal((rows, cols), dtype=np.float32) * std).astype(np.float16)

    embedding = rng.standard_normal((args.vocab, args.embd), dtype=np.float32) * 0.02
    output = rng.standard_normal((args.vocab, args.embd), dtype=np.float32) * 0.3
    embedding[:, 0] = 10.0  # the constant channel that carries the logit bias
    bias = np.where(np.asarray(types) == NORMAL, 0.0, -60.0).astype(np.float32)
    bias[2] = args.eos_bias
    bias[tokens.index("<|im_end|>")] = args.eos_bias
    output[:, 0] = bias / np.sqrt(args.embd)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(args.out), "llama")
    w.add_name("kvgate-tiny-llama")
    w.add_context_length(args.ctx)
    w.add_embedding_length(args.embd)
    w.add_block_count(args.layers)
    w.add_feed_forward_length(args.ff)
    w.add_head_count(args.heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(args.vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHATML)

    w.add_tensor("token_embd.weight", embedding.astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(args.embd, dtype=np.float32))
    w.add_tensor("output.weight", output.astype(np.float16))
    for layer in range(args.layers):
        p = f"blk.{layer}."
        w.add_tensor(p + "attn_norm.weight", np.ones(args.embd, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", matrix(args.embd, args.embd))
        w.add_tensor(p + "attn_k.weight", matrix(kv_dim, args.embd))
        w.add_tensor(p + "attn_v.weight", matrix(kv_dim, args.embd))
        w.add_tensor(p + "attn_output.weight", matrix(args.embd, args.embd))
        w.add_tensor(p + "ffn_norm.weight", np.ones(args.embd, dtype=np.float32))
        w.add_tensor(p + "ffn_gate.weight", matrix(args.ff, args.embd))
        w.add_tensor(p + "ffn_up.weight", matrix(args.ff, args.embd))
        w.add_tensor(p + "ffn_down.weight", matrix(args.embd, args.ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {args.out}: llama {args.layers} layers, n_embd {args.embd}, vocab {args.vocab}")


if __name__ == "__main__":
    main()
