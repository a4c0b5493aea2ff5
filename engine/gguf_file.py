"""A GGUF file's metadata and tensors, read fast.

gguf.GGUFReader parses every metadata value through numpy views, one per string: SmolLM2's tokenizer
(49,152 tokens and 48,900 merges) took it 6.6 s here, in every process that loads the model or the
tiny-random test model (workers, drivers, tests). This reads the same header (the format in
ggml/docs/gguf.md: magic, version, tensor and key counts, key/value pairs, tensor infos, aligned data)
with struct, about 0.2 s, and leaves each tensor as a read-only numpy view of the memory-mapped file in
the shape gguf.GGUFReader gives it (quantized types as bytes per row), for gguf.quants.dequantize.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# value type -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}
MAX_ITEMS = 1 << 28  # an array or string longer than this is a corrupt (or hostile) file
_LENGTH = struct.Struct("<Q")


class GGUFError(ValueError):
    pass


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: int  # gguf.GGMLQuantizationType's value
    shape: tuple[int, ...]  # numpy order (GGUF lists dimensions innermost first)
    data: np.ndarray


class _Cursor:
    def __init__(self, buf):
        self.buf, self.at = buf, 0

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.at + size > len(self.buf):
            raise GGUFError(f"truncated GGUF file: {size} bytes wanted at offset {self.at}")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += size
        return value

    def count(self) -> int:
        n = self.take("Q")
        if n > MAX_ITEMS:
            raise GGUFError(f"a length of {n} at offset {self.at - 8} is past what a GGUF file holds")
        return n

    def string(self) -> str:
        n = self.count()
        raw = bytes(self.buf[self.at : self.at + n])
        if len(raw) != n:
            raise GGUFError(f"truncated GGUF file: a {n}-byte string at offset {self.at}")
        self.at += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == 8:
            return self.string()
        if kind != 9:
            raise GGUFError(f"unknown GGUF value type {kind} at offset {self.at - 4}")
        item, n = self.take("I"), self.count()
        if item in _SCALARS:  # numbers: one numpy read
            fmt = _SCALARS[item]
            size = struct.calcsize(fmt) * n
            if self.at + size > len(self.buf):
                raise GGUFError(f"truncated GGUF file: an array of {n} at offset {self.at}")
            values = np.frombuffer(self.buf, np.dtype("<" + fmt), n, self.at).tolist()
            self.at += size
            return values
        if item == 8:
            return self._strings(n)
        return [self.value(item) for _ in range(n)]

    def _strings(self, n: int) -> list[str]:
        """n strings in a row (a tokenizer's tokens and merges: 98,052 of them in SmolLM2's), in one loop
        without a call per string (0.9 s of the 1.0 s this file took on an AVX2 EPYC before)."""
        buf, at, end, length = self.buf, self.at, len(self.buf), _LENGTH.unpack_from
        out = []
        for _ in range(n):
            if at + 8 > end:
                raise GGUFError(f"truncated GGUF file: a string's length wanted at offset {at}")
            (size,) = length(buf, at)
            at += 8
            if size > MAX_ITEMS or at + size > end:
                raise GGUFError(f"truncated GGUF file: a {size}-byte string at offset {at}")
            out.append(str(buf[at : at + size], "utf-8", "replace"))
            at += size
        self.at = at
        return out


def read_gguf(path: Path) -> tuple[dict, list[Tensor]]:
    """(metadata as Python values, tensors) of the GGUF file at path (version 2 or 3)."""
    import gguf

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file (it does not start with b'GGUF')")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    c = _Cursor(buf)
    c.at = 4
    version = c.take("I")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    n_tensors, n_kv = c.count(), c.count()
    fields = {}
    for _ in range(n_kv):
        key = c.string()
        fields[key] = c.value(c.take("I"))
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = [c.take("Q") for _ in range(c.take("I"))]
        infos.append((name, dims, c.take("I"), c.take("Q")))
    align = fields.get("general.alignment", 32)
    start = -(-c.at // align) * align
    tensors = []
    for name, dims, kind, offset in infos:
        shape = tuple(reversed(dims))
        try:
            qtype = gguf.GGMLQuantizationType(kind)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name!r} has an unknown type {kind}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        count = int(np.prod(dims, dtype=np.int64))
        if kind in _PLAIN:
            dtype, n = _PLAIN[kind], count
        else:  # quantized: bytes per row
            dtype, n = np.uint8, count * type_size // block
            shape = gguf.quant_shape_to_byte_shape(shape, qtype)
        at = start + offset
        if at + n * np.dtype(dtype).itemsize > len(buf):
            raise GGUFError(f"{path}: tensor {name!r} runs past the end of the file")
        tensors.append(Tensor(name, kind, shape, np.frombuffer(buf, dtype, n, at).reshape(shape)))
    return fields, tensors
