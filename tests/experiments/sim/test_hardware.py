import json

import pytest

from experiments.sim import hardware
from experiments.sim.calibrate import FitAtBound, Point, at_bound, fit, predict
from experiments.sim.cost import CostModel, Efficiency
from experiments.sim.models import sim_model

THIS = {
    "name": "cpu-this-machine",
    "measure": {"threads": 1, "dtype": "bfloat16"},
    "hbm_bytes": 1e9,
    "nic_bw": 1e9,
}


def _fake(flops: float, calls: list):
    def measure(threads, device="cpu", dtype="bfloat16"):
        calls.append((threads, device, dtype))
        return hardware.Hardware(
            "cpu-measured", flops, 20e9, 1e9, 20e9, 20e9, devices_per_node=1, read_bw=25e9
        )

    return measure


def test_this_machine_is_measured_once_per_cpu_model_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("PDK_CACHE_DIR", str(tmp_path))
    calls: list = []
    monkeypatch.setattr(hardware, "measure", _fake(1.8e12, calls))
    monkeypatch.setattr(hardware, "cpu_model", lambda: "Intel(R) Xeon(R) Processor")
    first = hardware.hardware_of(THIS)
    again = hardware.hardware_of(THIS)
    assert calls == [(1, "cpu", "bfloat16")] and first.flops == again.flops == 1.8e12
    assert first.read_bw == again.read_bw == 25e9  # the streaming read kept beside the copy
    assert first.nic_bw == 1e9 and "Xeon" in first.source and "measured here" in first.source
    (kept,) = tmp_path.joinpath("machines").iterdir()
    assert json.loads(kept.read_text())["cpu"] == "Intel(R) Xeon(R) Processor"
    monkeypatch.setattr(hardware, "cpu_model", lambda: "AMD EPYC 9R14")  # another machine: its own figures
    monkeypatch.setattr(hardware, "measure", _fake(0.2e12, calls))
    assert hardware.hardware_of(THIS).flops == 0.2e12 and len(calls) == 2
    kept.write_text("{not json")  # a torn or edited file is measured again, not trusted
    monkeypatch.setattr(hardware, "cpu_model", lambda: "Intel(R) Xeon(R) Processor")
    assert hardware.hardware_of(THIS).flops == 0.2e12 and len(calls) == 3


def test_two_cpus_of_one_name_but_another_isa_are_measured_apart(tmp_path, monkeypatch):
    """Zen 3 and Zen 4 both call themselves "AMD EPYC"; one has no AVX-512 BF16 and runs a bf16 GEMM 80x
    slower (a conversion in every product), so their figures are kept apart, and `auto` measures the
    dtype the engine computes in there (model.dtype auto: bf16 only where the CPU has it)."""
    from pdkernels import cpuinfo

    monkeypatch.setenv("PDK_CACHE_DIR", str(tmp_path))
    calls: list = []
    monkeypatch.setattr(hardware, "measure", _fake(70e9, calls))
    monkeypatch.setattr(hardware, "cpu_model", lambda: "AMD EPYC")
    auto = {**THIS, "measure": {"threads": 1, "dtype": "auto"}}
    for flags, dtype, isa in (
        ("avx2 fma", "float32", "avx2"),
        ("avx2 avx512f avx512_bf16", "bfloat16", "avx512_bf16"),
    ):
        monkeypatch.setattr(cpuinfo, "flags", lambda flags=flags: f"flags : {flags}")
        hw = hardware.hardware_of(auto)
        assert calls[-1] == (1, "cpu", dtype) and hw.bf16 is (dtype == "bfloat16"), flags
        assert f"AMD EPYC ({isa})" in hw.source and dtype in hw.source
    assert len(calls) == 2 and len(list(tmp_path.joinpath("machines").iterdir())) == 2


def test_a_bad_measure_spec_is_refused_naming_it():
    for spec in ({"threads": 0}, {"dtype": "int4"}, {"dtype": "Auto"}):
        with pytest.raises(ValueError, match="hardware.measure must have threads >= 1 and dtype one of"):
            hardware.hardware_of({**THIS, "measure": spec})


def test_the_real_measurement_gives_a_peak_and_a_bandwidth():
    hw = hardware.load_hardware("cpu-this-machine")  # the test run's own cache (tests/conftest.py)
    assert hw.flops > 1e9 and hw.hbm_bw > 1e8 and hw.read_bw > 1e8 and hw.name == "cpu-this-machine"


def test_a_fit_against_another_machines_figures_is_refused_not_pinned():
    """Steps from a core 9x faster (AMX against AVX-512) fitted against the slower one's
    peak would pin the linear efficiency at the grid's top; the fit says so instead."""
    model = sim_model("smollm2-135m")
    amx = hardware.Hardware("amx", 1.8e12, 20e9, 16e9, 20e9, 20e9, devices_per_node=1)
    epyc = hardware.Hardware("epyc", 0.2e12, 20e9, 16e9, 20e9, 20e9, devices_per_node=1)
    truth = CostModel(model, amx, 1, Efficiency(linear=0.6, attention=0.6, memory=0.7))
    shapes = [Point("prefill", n, 0, 0.0) for n in (256, 1024, 2048)] + [Point("decode", 8, 300, 0.0)]
    points = [Point(p.kind, p.size, p.kv, predict(truth, p)) for p in shapes]
    with pytest.raises(FitAtBound, match=r"linear 1.00 \(its upper bound\).*machine model epyc"):
        fit(model, epyc, points)
    kept, _ = fit(model, epyc, points, allow_bound=True)
    assert "linear 1.00 (its upper bound)" in at_bound(kept)
    right, err = fit(model, amx, points)  # against the machine that ran them: the truth, inside the grid
    assert right.linear == pytest.approx(0.6, abs=0.05) and not at_bound(right) and err < 1e-3
