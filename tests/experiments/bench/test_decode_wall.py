"""experiments/bench/decode_wall.py, tried small: a row per case with its share of the measured read, and
its arguments refused with the allowed forms named."""

import pytest

from experiments.bench import decode_wall
from pdkernels import cpu


def test_a_case_is_timed_against_the_read_measured_beside_it(capsys):
    if cpu.module() is None:
        pytest.skip("pdkernels' CPU extension could not be built here (no C++ compiler)")
    decode_wall.main(["--cases", "2x64,1x40", "--dtypes", "float32", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "streaming read" in out and "| float32 | 2 x 64 |" in out and "| float32 | 1 x 40 |" in out
    row = next(line for line in out.splitlines() if line.startswith("| float32 | 2 x 64 |"))
    assert row.count("%") == 1 and float(row.split("|")[3]) > 0  # one build: its ms, its GB/s and share


@pytest.mark.parametrize(
    "args, message",
    [
        (["--cases", "8by4096"], "BATCHxTOKENS"),
        (["--cases", "0x4096"], "BATCHxTOKENS"),
        (["--dtypes", "int8"], "--dtypes"),
        (["--against", "no-such-revision-here"], "not in that revision"),
    ],
)
def test_bad_arguments_say_what_is_allowed(args, message):
    if "--against" in args and cpu.module() is None:
        pytest.skip("pdkernels' CPU extension could not be built here (no C++ compiler)")
    with pytest.raises(SystemExit, match=message):
        decode_wall.main([*args, "--rounds", "1", "--cases", "1x16"] if "--cases" not in args else args)
