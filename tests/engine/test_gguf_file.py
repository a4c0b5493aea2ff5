"""engine/gguf_file.py against gguf's own reader, on a file gguf's writer made; and broken files."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from engine.gguf_file import GGUFError, read_gguf  # noqa: E402


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("gguf") / "small.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_string("general.name", "small ünïcode")
    w.add_token_list(["<s>", "a", "b", "ç", ""])
    w.add_token_scores([0.0, -1.5, -2.0, -3.25, 0.5])
    w.add_token_types([3, 1, 1, 1, 1])
    w.add_array("tokenizer.ggml.merges", ["a b", "ab ç"])
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((5, 64)).astype(np.float32))
    w.add_tensor("blk.0.attn_norm.weight", rng.standard_normal(64).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_up.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p


def test_the_same_fields_and_tensors_as_gguf_s_reader(path):
    fields, tensors = read_gguf(path)
    reader = gguf.GGUFReader(path)
    want = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert fields == want
    assert {k: type(v) for k, v in fields.items()} == {k: type(v) for k, v in want.items()}
    assert fields["tokenizer.ggml.tokens"][3] == "ç" and fields["general.name"] == "small ünïcode"
    assert [t.name for t in tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(tensors, reader.tensors, strict=True):
        assert ours.tensor_type == int(theirs.tensor_type) and ours.data.dtype == theirs.data.dtype
        assert ours.data.shape == theirs.data.shape and np.array_equal(ours.data, theirs.data)
    q = tensors[2]
    got = gguf.quants.dequantize(q.data, gguf.GGMLQuantizationType(q.tensor_type))
    assert got.shape == (4, 64)


def test_a_broken_or_hostile_file_is_a_clear_error_not_a_crash(path, tmp_path):
    raw = path.read_bytes()
    cases = {
        "magic": b"GGUX" + raw[4:],
        "version": raw[:4] + (9).to_bytes(4, "little") + raw[8:],
        "truncated": raw[:200],
        "a length of 2**60": raw[:8] + raw[8:16] + (1 << 60).to_bytes(8, "little") + raw[24:],
        "tensors cut off": raw[: len(raw) - 64],
        "empty": b"",
    }
    for what, data in cases.items():
        p = tmp_path / f"{what}.gguf"
        p.write_bytes(data)
        with pytest.raises(GGUFError):
            read_gguf(p)


@pytest.mark.parametrize("name", ["smollm2-135m", "tiny-random-moe"])
def test_a_scheduling_process_reads_the_config_and_tokenizer_without_the_weights(name):
    """load_model(weights=False), what drivers and servers call: the same config and tokenizer as a full
    load (vocab from the embedding's rows, tied from the missing output tensor), no weights."""
    from engine.weights import load_model

    light, full = load_model(name, weights=False), load_model(name)
    assert light.config == full.config and light.weights == {} and full.weights
    assert light.tokenizer.encode("Paris is") == full.tokenizer.encode("Paris is")
