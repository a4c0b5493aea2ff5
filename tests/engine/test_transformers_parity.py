"""Greedy tokens equal transformers' on the same weights (transformers is a test-only dependency)."""

import functools
import re

import pytest
import torch

from engine import LLM, SamplingParams
from engine.weights import smollm2_gguf_path
from tests.hf import hf_greedy

transformers = pytest.importorskip("transformers")
PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Paris is the capital of",
    "1, 2, 3, 4,",
    "Once upon a time, in a land far away,",
]


@pytest.fixture(scope="module")
def smollm2():
    return LLM("smollm2-135m", num_pages=128)


@pytest.fixture(scope="module", autouse=True)
def gguf_read_once():
    """transformers parses SmolLM2's GGUF with gguf's pure-Python reader once for the config, once for the
    weights and once for the tokenizer, and rebuilds gguf's tensor-name table for each of its 272 tensors:
    40 s of this module's 60. Here each is made once (the same objects, so the same answers)."""
    import gguf

    with pytest.MonkeyPatch.context() as patch:
        for name in ("GGUFReader", "get_tensor_name_map"):  # transformers imports them from gguf per call
            if hasattr(gguf, name):
                patch.setattr(gguf, name, functools.lru_cache(maxsize=4)(getattr(gguf, name)))
        yield


def test_smollm2_matches_transformers_llama(smollm2):
    path = smollm2_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    assert type(hf).__name__ == "LlamaForCausalLM"
    prompts = PROMPTS[:3] + [smollm2.apply_chat_template("Tell me a joke.")]
    outs = smollm2.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for out in outs:
        assert out.token_ids == hf_greedy(hf, out.prompt_token_ids, 24), out.prompt


def test_smollm2_tokenizer_matches_transformers(smollm2):
    path = smollm2_gguf_path()
    hf_tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    texts = PROMPTS + [
        "Numbers 12345 and 3.14159, ünïcödé, emoji 🙂, tabs\tand\nnewlines  double  spaces",
        "<|im_start|>user\nHi<|im_end|>\n",
    ]
    for text in texts:
        ids = smollm2.tokenizer.encode(text)
        assert ids == hf_tok(text, add_special_tokens=False).input_ids, text
        assert smollm2.tokenizer.decode(ids, skip_special_tokens=False) == text
    chat = smollm2.apply_chat_template("Hi")
    assert chat == hf_tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert smollm2.generate(chat, SamplingParams(max_tokens=8))[0].text.strip()  # an answer, in words


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_hf_directory_matches_transformers(tmp_path, arch):
    """A tiny random Llama (GQA, untied) or Qwen3 (q/k norm) in safetensors loads and decodes the same."""
    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen3Config(head_dim=16, **common)
        model = transformers.Qwen3ForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2 if p.dim() > 1 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)
    model.save_pretrained(tmp_path)
    LLM("tiny-random").tokenizer.tokenizer.save(str(tmp_path / "tokenizer.json"))
    llm = LLM(str(tmp_path), page_size=4, num_pages=64)
    assert llm.config.arch.qk_norm == (arch == "qwen3")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True))
    for out in outs:
        assert out.token_ids == hf_greedy(model.eval(), out.prompt_token_ids, 10), out.prompt


def test_a_hub_id_loads_from_the_local_cache_only(tmp_path, monkeypatch):
    """model="org/name" finds the snapshot in HF_HUB_CACHE (laid out as huggingface_hub does); a hub id
    that is not cached is a clear error, never a download."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "hub" / "models--pdk--tiny-llama"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(snapshot)
    LLM("tiny-random").tokenizer.tokenizer.save(str(snapshot / "tokenizer.json"))
    llm = LLM("pdk/tiny-llama", page_size=4, num_pages=32)
    assert llm.config.arch.num_layers == 2
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        LLM("pdk/not-downloaded")


def test_hf_directory_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="architectures must be one of"):
        LLM(str(tmp_path))


@pytest.mark.parametrize(
    "key, value, tensor",
    [
        ("vocab_size", 10**10, "model.embed_tokens.weight"),  # a hostile config's lies: the vocabulary,
        ("hidden_size", 10**7, "model.embed_tokens.weight"),  # the hidden size
        ("intermediate_size", 10**9, "model.layers.0.mlp.gate_proj.weight"),  # and the MLP's width
        ("num_key_value_heads", 4, "model.layers.0.self_attn.k_proj.weight"),
        ("num_hidden_layers", 3, "model.layers.2."),  # a layer the weights do not have
    ],
)
def test_a_config_that_disagrees_with_its_tensors_does_not_load(tmp_path, key, value, tensor):
    """Every config.json dimension that sizes a tensor is checked against the safetensors headers (before
    any tensor is read, and for a scheduler-only load too): a clear error naming the tensor and the config."""
    import json

    from engine.weights import load_model

    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    assert load_model(str(tmp_path)).config.vocab_size == 512  # as saved: it loads
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for weights in (True, False):
        with pytest.raises(ValueError, match=re.escape(tensor)) as err:
            load_model(str(tmp_path), weights=weights)
        message = str(err.value)
        assert str(tmp_path) in message and "config.json" in message
        if key != "num_hidden_layers":  # the shape's mismatch names the dimension's value
            assert f"{key}={value}" in message, message
