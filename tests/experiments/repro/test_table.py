import pytest

from experiments.repro import table
from experiments.repro.claims import SIMULATED, Claim

FAKE = [
    Claim("a", "one claim", "a seed", 1.0, "x", 1.1, SIMULATED, "none"),
    Claim("b", "another", "a seed", 1.0, "x", 3.0, SIMULATED, "none", note="why"),
    Claim("c", "a fitted one", "a seed", 1.0, "x", 1.0, SIMULATED, "none", fitted=True),
]


def test_the_table_goes_between_the_markers_and_nowhere_else(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(table, "all_claims", lambda n, trace_n, measure: FAKE)
    doc = tmp_path / "reproduction.md"
    doc.write_text(f"# Title\n\nbefore\n{table.BEGIN}\nold table\n{table.END}\nafter\n")
    assert table.main(["--requests", "100", "--trace-requests", "100", "--write", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Title\n\nbefore\n") and text.endswith(f"{table.END}\nafter\n")
    assert "old table" not in text and "`a` one claim" in text
    assert "1 of 2 checked claims reproduced" in text and "1 rows fitted" in text
    assert "`b` another" in capsys.readouterr().out
    table.main(["--requests", "100", "--write", str(doc)])  # again: one table, not two
    assert doc.read_text().count("`a` one claim") == 1


def test_bad_arguments_are_refused_naming_them(tmp_path, capsys):
    with pytest.raises(SystemExit):
        table.main(["--requests", "5"])
    assert "--requests and --trace-requests must be >= 100" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        table.main(["--write", str(tmp_path / "missing.md")])
    assert "--write must be an existing markdown file" in capsys.readouterr().err
    doc = tmp_path / "plain.md"
    doc.write_text("no markers\n")
    with pytest.raises(SystemExit, match="needs the lines"):
        table.write(doc, "t", "h")
