"""experiments.repro.streaming: the links scaled from real pairs, and the table's derived columns."""

import argparse

import pytest

from experiments.repro import streaming


def _args(model="smollm2-135m", links=("cx8", "cx7", "efa", "eth25")):
    return argparse.Namespace(model=model, prompt=1536, output=16, requests=4, chunk=512, links=list(links))


def test_a_link_here_keeps_the_real_pairs_link_time_over_compute_time_per_layer():
    real_s, real_kv, tp = streaming.real_layer_s("smollm2-135m", 1536)
    rates = streaming.link_rates(_args(), here_layer_s=0.04, here_kv_layer=real_kv, kv_dtype="auto")
    for key, (_, bits) in rates.items():
        pair = streaming.PAIRS[key]
        # link time per layer over compute time per layer, here and on the real pair
        here = real_kv * 8 / bits / 0.04
        real = real_kv * 8 / pair.bits / real_s
        assert here == pytest.approx(real)
    slower = streaming.link_rates(_args(), here_layer_s=0.08, here_kv_layer=real_kv, kv_dtype="auto")
    assert slower["cx7"][1] == pytest.approx(rates["cx7"][1] / 2)  # half the compute rate: half the link


def test_pairs_that_scale_to_one_rate_share_a_run_and_a_row():
    rates = streaming.link_rates(_args(), here_layer_s=0.04, here_kv_layer=1000.0, kv_dtype="auto")
    assert "efa" not in rates and "3.2 Tb/s EFA" in rates["cx7"][0]  # 400 Gb/s per GPU, both
    assert rates["cx8"][1] == pytest.approx(2 * rates["cx7"][1])


def test_a_per_node_link_is_shared_by_the_instances_gpus_and_a_per_gpu_one_is_not():
    """DeepSeek on 8 GPUs: per-GPU NICs add up to 8 x 400 Gb/s; the node's one Ethernet link stays 25."""
    rates = streaming.link_rates(_args("random-deepseek-v3", ("cx7", "eth25")), 1.0, 1000.0, "auto")
    assert rates["cx7"][1] == pytest.approx(rates["eth25"][1] * 8 * 400 / 25)


def _row(mode, link, ttft, exposed, compute=1.0):
    return {
        "variant": f"{mode}-{link}", "kv_dtype": "auto", "mode": mode, "link": link, "completed": 4,
        "requests": 4,
        "ttft_p50_s": ttft, "ttft_p90_s": ttft, "tpot_p50_s": 0.03, "compute_p50_s": compute,
        "exposed_p50_s": exposed, "exposed_p90_s": exposed, "kv_bytes": 1000, "nic_tx_bytes": 1010,
    }  # fmt: skip


def test_the_share_hidden_is_against_the_whole_request_mode_on_the_same_link():
    rows = [
        _row(None, None, 1.0, None),
        _row("layer", "cx7", 1.2, 0.01),
        _row("request", "cx7", 2.0, 1.0),
        _row("layer", "eth25", 3.0, 1.5),  # no whole-request run on this link: nothing to compare with
    ]
    rates = {"cx7": ("cx7 label", 2e8), "eth25": ("eth25 label", 1e7)}
    lines = streaming.table(rows, rates, here_layer_s=0.04, kv_layer_bytes=1e6).splitlines()
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[2:]]
    assert cells[1][6] == "+200" and cells[1][9] == "99%" and cells[2][9] == "0%" and cells[3][9] == "-"
    assert cells[1][3] == f"{1e6 * 8 / 2e8 / 0.04:.3g}"  # link over compute per layer
    assert cells[1][1] == "auto" and cells[1][11] == "0.00" and cells[1][12] == "1.010"  # 1,000 bytes of 4


def test_the_simulator_rows_hide_more_per_layer_than_whole_and_never_beat_colocated():
    rows = streaming.simulated(_args(links=("cx7", "eth25")), ["cx7", "eth25"], "auto")
    base = rows[0]["ttft_p50_s"]
    by = {(r["pair"], r["mode"]): r["ttft_p50_s"] for r in rows[1:]}
    for link in ("cx7", "eth25"):
        assert base < by[link, "layer"] <= by[link, "request"]
    assert by["eth25", "request"] > by["cx7", "request"]  # a slower link costs more


def test_e4m3_kv_is_half_the_real_bf16_bytes_and_its_scales_and_a_row_stands_for_the_same_link():
    """A real pair's e4m3 KV: a byte an element and a float32 scale per 16-token page, plane and head
    (SmolLM2: 64-wide heads, 0.4% more); here the scales' share is the engine's page size's. Scaled with
    its own bytes, an e4m3 run's link takes the link time over compute time per layer of the real pair in
    e4m3 (half bf16's): the same real link."""
    _, bf16, _ = streaming.real_layer_s("smollm2-135m", 1536)
    real_s, fp8, _ = streaming.real_layer_s("smollm2-135m", 1536, "fp8_e4m3")
    assert fp8 == pytest.approx(bf16 / 2 * (1 + 4 / (16 * 64)))
    here_kv = 1000.0
    rates = streaming.link_rates(_args(), 0.04, here_kv, "fp8_e4m3")
    for key, (_, bits) in rates.items():
        pair = streaming.PAIRS[key]
        assert here_kv * 8 / bits / 0.04 == pytest.approx(fp8 * 8 / pair.bits / real_s)
    from engine.weights import load_model

    arch = load_model("smollm2-135m", weights=False).config
    e4m3 = streaming.here_kv_layer(arch, 16, "float32", "fp8_e4m3")
    fp32 = streaming.here_kv_layer(arch, 16, "float32", "auto")
    assert e4m3 == pytest.approx(fp32 / 4 * (1 + 4 / (16 * 64)))
    simulated = streaming.simulated(_args(links=("eth25",)), ["eth25"], "fp8_e4m3")
    as_released = streaming.simulated(_args(links=("eth25",)), ["eth25"], "auto")
    assert simulated[-1]["ttft_p50_s"] < as_released[-1]["ttft_p50_s"]  # half the bytes on a slow link
