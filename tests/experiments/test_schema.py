"""One declaration of every setting (experiments/schema.py): conf/ holds presets that say only what differs
from what they extend, every key has a default and a comment in its dataclass, and --help lists them."""

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from experiments.schema import GROUPS, defaults, keys

CONF = Path(__file__).resolve().parents[2] / "conf"


def _body(path: Path) -> tuple[list[str], dict]:
    raw = OmegaConf.to_container(OmegaConf.load(path))
    return [d for d in raw.pop("defaults", []) if d != "_self_"], raw


def _inherited(group: str, option: str) -> dict:
    """What a preset's defaults list gives it before its own keys (the group's _defaults, another preset)."""
    parents, body = _body(CONF / group / f"{option}.yaml")
    base: dict = {}
    for parent in parents:
        base = _merge(base, defaults(GROUPS[group]) if parent == "_defaults" else _resolved(group, parent))
    return base


def _resolved(group: str, option: str) -> dict:
    return _merge(_inherited(group, option), _body(CONF / group / f"{option}.yaml")[1])


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def repeats(body: dict, base: dict, at: str = "") -> list[str]:
    """The keys of body whose value is what base already has (declared twice)."""
    out = []
    for k, v in body.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            out += repeats(v, base[k], f"{at}{k}.")
        elif k in base and base[k] == v:
            out.append(f"{at}{k}")
    return out


PRESETS = [
    (group, p.stem)
    for group in GROUPS
    if (CONF / group).is_dir()
    for p in sorted((CONF / group).glob("*.yaml"))
    if not p.read_text().startswith("# @package _global_")
]


@pytest.mark.parametrize("group, option", PRESETS, ids=[f"{g}/{o}" for g, o in PRESETS])
def test_a_preset_says_only_what_differs_from_what_it_extends(group, option):
    parents, body = _body(CONF / group / f"{option}.yaml")
    assert parents, "a preset starts from its group's _defaults or another preset"
    assert not repeats(body, _inherited(group, option))
    assert not set(body) - set(defaults(GROUPS[group])), "a key its dataclass does not have"


def test_the_check_finds_a_default_declared_again():
    base = defaults(GROUPS["deployment"])
    assert repeats({"name": "x", "fair_share": True, "planner": {"enabled": False, "patience": 3}}, base) == [
        "fair_share",
        "planner.enabled",
    ]


def test_the_top_level_config_holds_no_values_of_its_own():
    raw = OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml"))
    assert set(raw) == {"defaults", "hydra"}


def test_every_key_has_a_comment_and_help_lists_them_all():
    rows = keys()
    assert not [key for key, _, note in rows if not note], "a field without a comment in its dataclass"
    out = subprocess.run(
        [sys.executable, "-m", "experiments.run", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    assert len(rows) > 140
    for key, _, _ in rows:
        assert f"\n  {key} = " in out, key
    assert "  deployment.fair_share = true\n      # ... but no more than its share" in out


def _override(value) -> str:
    """A value as hydra's override grammar writes it."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return "'" + value.replace("'", "\\'") + "'"
    if isinstance(value, list):
        return "[" + ",".join(map(_override, value)) + "]"
    return "{" + ",".join(f"{k}:{_override(v)}" for k, v in value.items()) + "}"


def test_every_key_help_listed_still_works_unchanged():
    """Each key of tests/data/help_keys.txt (what --help listed before the engine's settings became one
    object) is still listed, and set to the value it composes to it resolves to the same config: a key
    renamed or dropped without a word fails here."""
    from hydra import compose, initialize_config_dir

    from experiments.config import from_cfg

    listed = [
        line
        for line in (CONF.parent / "tests/data/help_keys.txt").read_text().splitlines()
        if line[:1] != "#"
    ]
    now = {key for key, _, _ in keys()}
    assert len(listed) == 160 and not [key for key in listed if key not in now]
    by_group: dict[str, list[str]] = {}  # the launcher group a key needs -> its keys
    for key in listed:
        group = {"ray": "launcher=ray", "cluster": "launcher=netns"}.get(key.split(".")[0], "")
        by_group.setdefault(group, []).append(key)
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        for group, group_keys in by_group.items():  # one composition a group: hydra names a key it refuses
            base = [group] if group else []
            composed = compose("config", overrides=base)
            raw, config = OmegaConf.to_container(composed, resolve=False), from_cfg(composed)
            overrides = []
            for key in group_keys:
                value = raw
                for part in key.split("."):
                    value = value[part]
                overrides.append(f"{key}={_override(value)}")
            assert from_cfg(compose("config", overrides=[*base, *overrides])) == config, overrides
