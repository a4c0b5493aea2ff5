"""Stream one completion: python -m engine.generate --model smollm2-135m --prompt "..." """

from __future__ import annotations

import argparse
import sys

from engine.llm import LLM
from engine.sequence import SamplingParams
from engine.weights import KNOWN_MODELS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate text with the pdkernels engine, streaming tokens.")
    parser.add_argument(
        "--model", default="smollm2-135m", help=f"one of {KNOWN_MODELS}, a .gguf file or a HF dir"
    )
    parser.add_argument("--prompt", required=True)
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="wrap the prompt in the model's chat template (default: when it has one)",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        )
        llm = LLM(args.model, device=args.device, dtype=args.dtype, num_pages=256)
        chat = args.chat if args.chat is not None else bool(llm.tokenizer.chat_template)
        request_id = llm.add_request(llm.apply_chat_template(args.prompt) if chat else args.prompt, params)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    shown, out = "", None
    while llm.has_unfinished():
        for out in (o for o in llm.step() if o.request_id == request_id):
            print(out.text[len(shown) :], end="", flush=True)
            shown = out.text
    print(
        f"\n[{len(out.token_ids)} tokens, finish: {out.finish_reason}, TTFT {out.ttft * 1e3:.0f} ms"
        + (f", TPOT {out.tpot * 1e3:.1f} ms]" if out.tpot else "]"),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
