"""Write SmolLM2-135M (the GGUF the engine loads) as a Hugging Face folder: config.json, model.safetensors,
tokenizer files and chat template, dequantized to bf16. Other servers (vLLM's CPU build) then serve the
same weights as ours, for side-by-side runs through the load client (docs/results/engine-cpu.md).

    python scripts/export_hf.py OUT_DIR
"""

import argparse
import sys

import torch
import transformers

from engine.weights import smollm2_gguf_path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the folder to write")
    args = ap.parse_args()
    path = smollm2_gguf_path()
    gguf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.bfloat16
    )
    config = gguf.config
    if hasattr(config, "quantization_config"):  # a GGUF-loaded model refuses to save: copy it out plain
        del config.quantization_config
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.load_state_dict(gguf.state_dict())
    model.save_pretrained(args.out)
    transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
