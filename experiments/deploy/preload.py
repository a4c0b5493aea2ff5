"""What the local launcher's fork server does once for every worker it forks (launcher._fork_server):
import torch (3.4 s of CPU per process on an AVX2 EPYC) and read the tokenizer GGUF that every built-in
model uses (SmolLM2's, or PDKERNELS_TOKENIZER_GGUF's: 0.8 s). A forked worker inherits both. Nothing here
may stop the fork server: a file that cannot be read is left to the worker's own load to report."""

import torch  # noqa: F401

from engine.weights import read_builtin_tokenizer

try:
    read_builtin_tokenizer()
except Exception:  # a worker that needs the file says what is wrong with it
    pass
