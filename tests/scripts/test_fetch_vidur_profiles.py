"""scripts/fetch_vidur_profiles.py from a local clone: the profiles it finds written under the profiling
tree with the license beside them, the rest named as missing; no license, nothing fetched."""

import subprocess
from pathlib import Path

from tests.scripts import load_script

fetch = load_script("fetch_vidur_profiles")


def _repo(path: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git = ["git", "-C", str(path), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "profiles"], check=True)


def test_the_profiles_found_are_written_with_the_license(tmp_path, capsys):
    mlp = "data/profiling/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv"
    _repo(tmp_path / "vidur", {"LICENSE": "MIT License\n", mlp: "n_head\n32\n"})
    out = tmp_path / "out"
    assert fetch.main(["--from-git", str(tmp_path / "vidur"), "--commit", "HEAD", "--out", str(out)]) == 0
    assert (out / "LICENSE").read_text() == "MIT License\n"
    assert (out / "compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv").read_text() == "n_head\n32\n"
    assert f"1 files in {out}" in capsys.readouterr().out


def test_without_a_license_nothing_is_fetched(tmp_path):
    _repo(tmp_path / "vidur", {"data/profiling/compute/h100/x/y/mlp.csv": "n_head\n"})
    out = tmp_path / "out"
    assert fetch.main(["--from-git", str(tmp_path / "vidur"), "--commit", "HEAD", "--out", str(out)]) == 1
    assert not out.exists()
