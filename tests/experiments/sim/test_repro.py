from experiments.repro import distserve


def test_distserve_repro_prints_ours_beside_the_paper(capsys):
    assert distserve.main(["--requests", "200"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[3:]}
    assert set(rows) == {"colocated", "prefill-only", "decode-only", "2P1D"}
    assert all(float(v[1]) > 0 for v in rows.values())  # every setup serves some rate within the SLO
    # what disaggregation buys: 2P1D per GPU beats colocated, and a decode-only GPU beats a prefill-only one
    assert float(rows["2P1D"][1]) > float(rows["colocated"][1])
    assert float(rows["decode-only"][1]) > float(rows["prefill-only"][1])
