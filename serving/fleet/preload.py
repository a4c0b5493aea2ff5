"""What the local launcher's fork server does once for every worker it forks (launcher._fork_server):
import torch (3.4 s of CPU per process on an AVX2 EPYC) and xgrammar (1.2 s on a Xeon: every grammar
sandbox child and every worker that samples), and read the tokenizer GGUF that every built-in model uses
(SmolLM2's, or PDKERNELS_TOKENIZER_GGUF's: 0.8 s), and build or load pdkernels' C++ CPU paths (not the
job's front, which then runs without torch). A forked process inherits them: a grammar sandbox child
started for a client then is ready in a fraction of a second. Nothing here may stop the fork server: a
file that cannot be read is left to the worker's own load to report. And it ends with the job that
started it (its parent), however that job ends: left to itself, a SIGKILLed job's fork server lived on."""

import os

from serving.fleet.procs import die_with

die_with(os.getppid(), "the fork server")  # first: the imports below take seconds


def _load() -> None:
    import torch  # noqa: F401
    import xgrammar  # noqa: F401

    import engine.structured  # noqa: F401  (what a grammar child builds its compiler with)
    from engine.weights import read_builtin_tokenizer
    from pdkernels import cpu

    cpu.module()  # the C++ CPU paths, built once (about 20 s on a new machine) or loaded, for every worker

    try:
        read_builtin_tokenizer()
    except Exception:  # a worker that needs the file says what is wrong with it
        pass


_load()
