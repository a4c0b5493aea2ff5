"""scripts/compare_outputs.py over results.json files: each deployment's requests against the reference
deployment's same requests; a reference that is not there, or texts of other lengths, are refused."""

import json

import pytest

from tests.scripts import load_script

compare = load_script("compare_outputs")


def _run(folder, runs: dict[str, dict[str, list[int]]]):
    folder.mkdir()
    requests = {
        name: [{"request_id": i, "output_ids": ids} for i, ids in r.items()] for name, r in runs.items()
    }
    body = {"runs": [{"deployment": name, "requests": r} for name, r in requests.items()]}
    (folder / "results.json").write_text(json.dumps(body))
    return str(folder)


def test_each_deployment_is_compared_request_by_request_with_the_reference(tmp_path, capsys):
    a = _run(tmp_path / "a", {"ref": {"r0": [1, 2, 3, 4], "r1": [5, 6, 7, 8]}})
    other, ref = {"r1": [5, 6, 0, 8], "r0": [1, 2, 3, 4]}, {"r0": [9, 2, 3, 4], "r1": [5, 6, 7, 8]}
    b = _run(tmp_path / "b", {"other": other, "ref": ref})
    compare.main([a, b, "--against", "ref"])
    out = capsys.readouterr().out
    assert "| ref | 2 | 4.0 | 4.0 | 100% |" in out
    assert "| other | 2 | 3.0 | 3.5 | 50% |" in out  # r1 differs at its third token, r0 not at all
    assert "| ref (b) | 2 | 2.0 | 3.5 | 50% |" in out  # the second run's own ref, by its folder


def test_a_missing_reference_or_other_lengths_are_refused(tmp_path):
    a = _run(tmp_path / "a", {"ref": {"r0": [1, 2]}, "short": {"r0": [1]}})
    with pytest.raises(SystemExit, match="--against 'bf16': no such deployment"):
        compare.main([a, "--against", "bf16"])
    with pytest.raises(SystemExit, match="short: its requests' lengths differ from ref's"):
        compare.main([a, "--against", "ref"])
