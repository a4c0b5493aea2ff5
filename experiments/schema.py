"""Every setting is declared once: a field of a dataclass (its type, default and comment), and hydra gets
it from there. This module puts, for each config group and the top level, a node of the dataclasses'
defaults in hydra's ConfigStore (`<group>/_defaults`, and `pdk_defaults` for the top level); the files in
conf/ are presets that start from it and say only what differs (conf/deployment/2p1d.yaml is
`num_prefill: 2`). Checking stays where it was: each dataclass's __post_init__, through
experiments.config.from_cfg, with errors that name the key.

`python -m experiments.run --help` lists every key with its default and its comment (read from the
dataclass's source). Imported by experiments.config, so anything that composes the config has it.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import textwrap
import tokenize
from dataclasses import MISSING, fields

from hydra.core.config_store import ConfigStore

from engine.sequence import SamplingParams
from experiments.config import SET_BY_WORKLOAD, RunConfig, WorkloadConfig
from serving.config import (
    ClusterConfig,
    DeploymentConfig,
    KernelsConfig,
    KVTiersSpec,
    LauncherConfig,
    ModelSpec,
    RayConfig,
    SloConfig,
)
from serving.http.server_config import ServerConfig
from serving.router.planner import PlannerConfig
from transfer.config import TransferConfig

# group -> the dataclass its options fill (launcher: only name and max_restarts; ray and cluster are
# top-level keys of their own, which conf/launcher/ray.yaml and netns.yaml bring in)
GROUPS = {
    "model": ModelSpec,
    "deployment": DeploymentConfig,
    "workload": WorkloadConfig,
    "slo": SloConfig,
    "transfer": TransferConfig,
    "server": ServerConfig,
    "launcher": LauncherConfig,
    "ray": RayConfig,
    "cluster": ClusterConfig,
}
TOP = {"kernels": KernelsConfig, "kv_tiers": KVTiersSpec}
# the top level's keys that are RunConfig's own fields (their defaults and comments come from it)
RUN_FIELDS = ("run_timeout_s", "start_timeout_s", "log_level", "plots")
# the top level's keys no dataclass holds as such (from_cfg reads them), with their comments
TOP_KEYS = {
    "deployments": ([], "set by experiment configs that compare deployments on one workload (a list of "
                    "deployments); empty: the single `deployment` runs"),
    "goodput_search": ({"rates": []}, "run each deployment at each of these Poisson rates (req/s) and "
                       "report goodput, the highest rate whose SLO attainment meets the target; empty: "
                       "one run at workload.rate"),
}  # fmt: skip
# fields whose default (None) stands for a dataclass's defaults: the node holds those, so that
# `deployment.planner.enabled=true` needs no "+"
EXPANDED = {(DeploymentConfig, "planner"): PlannerConfig}
# fields a node leaves out: they live elsewhere in the tree (launcher's), or the workload sets them for
# each request (workload.sampling's: engine.SamplingParams)
LEFT_OUT = {LauncherConfig: {"ray", "cluster"}, SamplingParams: set(SET_BY_WORKLOAD)}


def _plain(value):
    if dataclasses.is_dataclass(value):
        left_out = LEFT_OUT.get(type(value), ())
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items() if k not in left_out}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def defaults(cls) -> dict:
    """cls's fields and their defaults as plain values ("???": required, hydra's MISSING)."""
    out = {}
    for f in fields(cls):
        if f.name in LEFT_OUT.get(cls, ()):
            continue
        if (cls, f.name) in EXPANDED:
            out[f.name] = defaults(EXPANDED[cls, f.name])
        elif f.default is not MISSING:
            out[f.name] = _plain(f.default)
        elif f.default_factory is not MISSING:
            out[f.name] = _plain(f.default_factory())
        else:
            out[f.name] = "???"
    return out


def comments(cls) -> dict[str, str]:
    """Each field's comment in the source of cls (and of the dataclasses it extends): the comment on its
    line, after the block above it."""
    out = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            out |= _own_comments(base)
    return out


def _own_comments(cls) -> dict[str, str]:
    source = textwrap.dedent(inspect.getsource(cls))
    out, block, current = {}, [], None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if tok.start[1] == 4 and tok.line.strip().startswith("#"):  # a line of its own in the body
                block.append(text)
            elif current is not None:
                out[current] = " ".join([*block, text]) if block else text
                block = []
        elif tok.type == tokenize.NAME and tok.start[1] == 4 and tok.string in cls.__dataclass_fields__:
            if current != tok.string:
                current = tok.string
                if block:
                    out[current] = " ".join(block)
                    block = []
        elif tok.type == tokenize.NAME and tok.start[1] == 4 and tok.string == "def":
            break
    return out


def keys() -> list[tuple[str, object, str]]:
    """(dotted key, default, comment) for every setting of the main job and the server."""
    run, notes = defaults(RunConfig), comments(RunConfig)
    rows = [(k, v, c) for k, (v, c) in TOP_KEYS.items()] + [(k, run[k], notes.get(k, "")) for k in RUN_FIELDS]
    for prefix, cls in {**GROUPS, **TOP}.items():
        notes = comments(cls)
        for name, value in defaults(cls).items():
            sub = EXPANDED.get((cls, name)) or _nested(cls, name)
            if sub is not None:
                sub_notes = comments(sub)
                rows += [(f"{prefix}.{name}.{k}", v, sub_notes.get(k, "")) for k, v in value.items()]
            else:
                rows.append((f"{prefix}.{name}", value, notes.get(name, "")))
    return rows


def _nested(cls, name: str):
    """The dataclass a field's default is an instance of (workload.prompt_len: LengthDist), or None."""
    f = cls.__dataclass_fields__[name]
    value = f.default_factory() if f.default_factory is not MISSING else None
    return type(value) if dataclasses.is_dataclass(value) else None


def help_text() -> str:
    def shown(value) -> str:
        text = "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)
        return text.replace("'", '"')

    lines = []
    for key, value, note in keys():
        lines.append(f"  {key} = {shown(value)}")
        lines += textwrap.wrap(note, 100, initial_indent="      # ", subsequent_indent="      # ")
    text = "\n".join(lines)
    assert "$" not in text, "hydra's help template reads $ (string.Template) and ${...} (OmegaConf)"
    return text


def register() -> None:
    store = ConfigStore.instance()
    for group, cls in GROUPS.items():
        store.store(group=group, name="_defaults", node=defaults(cls))
    run = defaults(RunConfig)
    top = {k: v for k, (v, _) in TOP_KEYS.items()} | {k: run[k] for k in RUN_FIELDS}
    top |= {k: defaults(cls) for k, cls in TOP.items()}
    store.store(name="pdk_defaults", node=top)
    store.store(
        group="hydra/help",
        name="pdk",
        node={
            "app_name": "pdkernels",
            "header": "python -m experiments.run [group=option ...] [key=value ...] (docs/experiments.md)",
            "footer": "Presets: conf/<group>/<option>.yaml. `--cfg job` prints the composed config.",
            "template": "${hydra.help.header}\n\nGroups (group=option; _defaults: the group's dataclass):\n"
            "$APP_CONFIG_GROUPS\n\nEvery key (key=value), its default and what it does:\n"
            + help_text()
            + "\n\n${hydra.help.footer}",
        },
    )


register()
