"""Write a LoRA adapter for the tiny model (engines/make_tiny_hf_model.py), in PEFT's format.

A real vLLM serves it next to the base model (``--enable-lora --lora-modules NAME=DIR``), and
its KV events name the adapter's blocks (``lora_name``): what kvgate's LoRA routing is tested
against. Rank 8 on the attention's q and v projections, seeded small random weights (the
answers do not matter; that the engine keys the adapter's KV apart from the base model's does).

Run with the vLLM venv's python (it has torch and safetensors):
    python make_tiny_lora.py --model DIR --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the tiny model's directory (its config.json)")
    ap.add_argument("--out", required=True, help="directory to write the adapter into")
    ap.add_argument("--rank", type=int, default=8)
    args = ap.parse_args()

    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(args.model) / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv_out = cfg.get("num_key_value_heads", heads) * (hidden // heads)
    torch.manual_seed(7)
    weights = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj, out_dim in (("q_proj", hidden), ("v_proj", kv_out)):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            a = torch.randn(args.rank, hidden) * 0.01
            weights[f"{name}.lora_A.weight"] = a.to(torch.bfloat16)
            weights[f"{name}.lora_B.weight"] = (torch.randn(out_dim, args.rank) * 0.01).to(
                torch.bfloat16
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": args.rank,
        "lora_alpha": 2 * args.rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": str(args.model),
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    print(f"wrote {out}: rank {args.rank}, {len(weights)} tensors")


if __name__ == "__main__":
    main()
