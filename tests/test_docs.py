"""The docs say only what the config has: every `deployment.*`, `workload.*` and `kv_tiers.*` key that
README.md or docs/*.md names exists in conf/ (under some deployment or workload option), so an override
the docs show does not fail with hydra's "Key ... is not in struct"."""

import re
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
# a dotted key after deployment. or workload., not a file name (workload.py), not after a "+" (hydra's
# append of a key the yaml does not have: +deployment.speculative=...)
KEY = re.compile(r"(?<![+\w./])((?:deployment|workload|kv_tiers)(?:\.(?!py\b)[a-z_][a-z0-9_]*)+)")


def _configs() -> list:
    """The composed config under every deployment and workload option in conf/."""
    out = []
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        for group in ("deployment", "workload"):
            for option in sorted((ROOT / "conf" / group).glob("*.yaml")):
                out.append(compose("config", overrides=[f"{group}={option.stem}"]))
    return out


def _named_keys() -> dict[str, set[str]]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found: dict[str, set[str]] = {}
    for path in docs:
        for match in KEY.finditer(path.read_text()):
            found.setdefault(match.group(1), set()).add(path.name)
    return found


def test_every_deployment_and_workload_key_the_docs_name_is_in_conf():
    configs = _configs()
    named = _named_keys()
    assert "deployment.chunk_size" in named and "workload.sampling.temperature" in named  # it reads them
    assert "kv_tiers.store_bytes" in named
    missing = {
        key: sorted(where)
        for key, where in named.items()
        if all(OmegaConf.select(c, key, default=KeyError) is KeyError for c in configs)
    }
    assert not missing, f"keys the docs name that conf/ lacks: {missing}"


@pytest.mark.parametrize(
    "text", ["`deployment.no_such_key=1`", "workload.sampling.tempreature", "kv_tiers.host_byts=1"]
)
def test_the_check_finds_a_key_conf_lacks(text):
    keys = [m.group(1) for m in KEY.finditer(text)]
    assert keys and all(OmegaConf.select(c, keys[0], default=KeyError) is KeyError for c in _configs())
