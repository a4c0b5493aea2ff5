"""Fetch Vidur's published GPU profiles (microsoft/vidur, MIT license) for experiments.sim.operators: each
GPU's and model's `mlp.csv` (a layer's operators but attention, by token count and TP degree), the
collectives' CSVs, and the license, at a pinned commit; `attention.csv` too where the source has it (at the
pinned commit it has none: the one attention profile in its public history, an A100's over Llama-2-70B's
heads at TP 2, is read from the first commit, EARLY, under the same license).

    python scripts/fetch_vidur_profiles.py [--out DIR] [--from-git REPO] [--commit REV]

--out (default ~/.cache/pdkernels/vidur): where data/profiling's tree is written, with LICENSE beside it.
--from-git: a local clone (or bare mirror) of microsoft/vidur to read from, instead of GitHub.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

REPO = "microsoft/vidur"
# the commit the profiles are read at: the one this repository's figures were made from (docs/results/)
COMMIT = (Path(__file__).parent / "vidur-profiles.pin").read_text().strip()
GPUS = ("a100", "h100", "a40")
MODELS = (
    "Qwen/Qwen-72B",
    "codellama/CodeLlama-34b-Instruct-hf",
    "internlm/internlm-20b",
    "meta-llama/Llama-2-70b-hf",
    "meta-llama/Llama-2-7b-hf",
    "meta-llama/Meta-Llama-3-70B",
    "meta-llama/Meta-Llama-3-8B",
    "microsoft/phi-2",
)
# files read at another commit than the pinned one (path -> commit): the first commit's A100 attention
EARLY = {
    "data/profiling/a100/attention.csv": (Path(__file__).parent / "vidur-attention.pin").read_text().strip()
}
NETWORK = ("a100_dgx", "a100_pairwise_nvlink", "h100_dgx", "h100_pairwise_nvlink", "a40_pairwise_nvlink")


def wanted() -> list[str]:
    files = [f"data/profiling/compute/{g}/{m}/{name}" for g in GPUS for m in MODELS for name in ("mlp.csv",
             "attention.csv")]  # fmt: skip
    return files + [
        f"data/profiling/network/{n}/{c}.csv" for n in NETWORK for c in ("all_reduce", "send_recv")
    ]


def read(path: str, from_git: Path | None, commit: str = COMMIT) -> bytes | None:
    """The file at commit, or None where the source does not have it (not every GPU has every model)."""
    if from_git is not None:
        git_dir = from_git / ".git" if (from_git / ".git").exists() else from_git
        shown = subprocess.run(
            ["git", "--git-dir", str(git_dir), "show", f"{commit}:{path}"], capture_output=True
        )
        return shown.stdout if shown.returncode == 0 else None
    url = f"https://raw.githubusercontent.com/{REPO}/{commit}/{path}"
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.read()
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdkernels" / "vidur"
    parser.add_argument("--out", type=Path, default=default)
    parser.add_argument("--from-git", type=Path, default=None)
    parser.add_argument("--commit", default=COMMIT)
    args = parser.parse_args(argv)
    license_text = read("LICENSE", args.from_git, args.commit)
    if license_text is None:
        print(f"no LICENSE at {args.commit} in the source: not fetching without it", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "LICENSE").write_bytes(license_text)
    got, missing = 0, []
    for path, commit in [(p, args.commit) for p in wanted()] + list(EARLY.items()):
        data = read(path, args.from_git, commit)
        if data is None or data.startswith(b"version https://git-lfs"):
            missing.append(path)
            continue
        target = args.out / path.removeprefix("data/profiling/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        got += 1
    some = ", ".join(missing[:4]) + (" ..." if len(missing) > 4 else "")
    print(f"{got} files in {args.out} (profiling tree; Vidur's MIT license in LICENSE); {len(missing)} not "
          f"in the source at {args.commit} (or EARLY's commit): {some}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
