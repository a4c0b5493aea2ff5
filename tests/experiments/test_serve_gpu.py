"""The HTTP server with its workers on a GPU, answering the official openai client (make gpu-check)."""

import pytest

from engine import LLM, SamplingParams
from tests.experiments.serving import PROMPTS, _start, _stop

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("deployment", ["colocated", "1p1d"])
def test_the_server_on_the_gpu_answers_with_the_cpu_engines_tokens(deployment, tmp_path):
    """tiny-random in fp32 on CUDA (1P1D: KV over NIXL in VRAM): completions, streamed and not, carry the
    text the CPU engine generates greedily."""
    reference = LLM("tiny-random", device="cpu", dtype="float32", page_size=4, num_pages=256)
    proc, url = _start(tmp_path, f"deployment={deployment}", "model.device=cuda", "model.dtype=float32")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        for prompt in PROMPTS:
            want = reference.generate([prompt], SamplingParams(max_tokens=12))[0].text
            got = client.completions.create(model="tiny-random", prompt=prompt, max_tokens=12, temperature=0)
            assert got.choices[0].text == want
            stream = client.completions.create(
                model="tiny-random", prompt=prompt, max_tokens=12, temperature=0, stream=True
            )
            assert "".join(c.choices[0].text for c in stream if c.choices) == want
    finally:
        _stop(proc)
