"""A RunConfig from text: a preset name or a TOML/JSON file, then `section.key=value` overrides (the CLI's
strings, Prefect's dicts), typed by the settings classes and validated once, before any work starts.

    cfg = load_config("tiny-cpu", ["train.max_steps=50", "model.n_layer=2"])
    cfg = load_config("my_run.toml")          # a file may name a `preset` to start from
    cfg = from_dict(meta["config"])           # a saved config (a run's config.json, a checkpoint's meta)

Keys of earlier layouts are still read (RENAMED_KEYS), so old checkpoints, deployments and overrides work.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from dataclasses import fields
from pathlib import Path

from gptcore.coerce import coerce
from gptcore.config import (
    EVAL_SECTIONS,
    ConfigError,
    EvalConfig,
    RunConfig,
    eval_option,
)
from gptcore.presets import preset
from gptcore.security import NAME_KEYS, check_name

# keys of an earlier layout, still read (saved configs, old overrides): the hub source's flat data.hf_* fields
# are its own section now, and so are the evaluations' flat eval.* fields (eval.hellaswag.limit)
RENAMED_KEYS = {"data.hf_repo": "data.hub.repo", "data.hf_config": "data.hub.config",
                "data.hf_split": "data.hub.split", "data.hf_revision": "data.hub.revision",
                "eval.hellaswag": "eval.hellaswag.enabled", "eval.hellaswag_interval": "eval.hellaswag.interval",
                "eval.hellaswag_path": "eval.hellaswag.path", "eval.hellaswag_limit": "eval.hellaswag.limit",
                "eval.exclude_contaminated": "eval.hellaswag.exclude_contaminated",
                "eval.harness_tasks": "eval.harness.tasks", "eval.harness_include_path": "eval.harness.include_path",
                "eval.harness_limit": "eval.harness.limit", "eval.harness_interval": "eval.harness.interval",
                "eval.harness_dtype": "eval.harness.dtype", "eval.contamination_ngram": "eval.contamination.ngram"}


def _set(cfg: RunConfig, key: str, value) -> None:
    key = RENAMED_KEYS.get(key, key)
    section_name, _, name = key.partition(".")
    sections = {f.name for f in fields(RunConfig) if dataclasses.is_dataclass(f.default_factory)}
    if section_name not in sections or not name:
        raise ConfigError(f"unknown config key {key!r}; keys look like section.name with section in "
                          f"{sorted(sections)}")
    section, path = getattr(cfg, section_name), section_name
    if section_name == "eval" and "." in name:  # an evaluation's own section: eval.<name>.<field>
        set_eval_option(cfg.eval, key, *name.split(".", 1), value)
        return
    while "." in name:  # a section inside a section (data.hub.repo)
        sub, _, name = name.partition(".")
        if not dataclasses.is_dataclass(getattr(section, sub, None)):
            raise ConfigError(f"unknown config key {key!r}; {path} has no section {sub!r}")
        section, path = getattr(section, sub), f"{path}.{sub}"
    hints = typing.get_type_hints(type(section))
    if name not in hints or dataclasses.is_dataclass(getattr(section, name)) or key == "eval.sections":
        has = sorted(set(hints) - {"sections"} if path == "eval" else hints)
        each = f", and eval.<evaluation>.<field> for {sorted(EVAL_SECTIONS)}" if path == "eval" else ""
        raise ConfigError(f"unknown config key {key!r}; {path} has {has}{each}")
    setattr(section, name, coerce(value, hints[name], key))


def set_eval_option(section: EvalConfig, key: str, name: str, option: str, value) -> None:
    """eval.<name>.<option>=value: typed and checked now when the evaluation is known in this process,
    else kept as given (EvalConfig.options types it where the evaluations are)."""
    if "." in option:
        raise ConfigError(f"unknown config key {key!r}; an evaluation's keys look like eval.<name>.<field>")
    if EVAL_SECTIONS:
        value = eval_option(name, option, value)
    section.sections.setdefault(name, {})[option] = value


def flatten(d: dict, prefix: str = "") -> dict[str, object]:
    """{"train": {"max_steps": 50}, "model.n_layer": 2} -> {"train.max_steps": 50, "model.n_layer": 2}: the
    one flattener (overrides from Prefect, the torchrun command line, MLflow params)."""
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def apply_overrides(cfg: RunConfig, overrides: list[str] | dict | None) -> RunConfig:
    """Apply `section.key=value` strings (CLI) or a {"section.key": value} / nested dict (Prefect)."""
    if not overrides:
        return cfg
    items: list[tuple[str, object]] = []
    if isinstance(overrides, dict):
        items = list(flatten(overrides).items())
    else:
        for text in overrides:
            if "=" not in text:
                raise ConfigError(f"override {text!r} is not of the form section.key=value")
            k, _, v = text.partition("=")
            items.append((k.strip(), v.strip()))
    for k, v in items:
        if k == "preset":
            raise ConfigError("'preset' cannot be overridden; pass it as the config name instead")
        if k in NAME_KEYS and v == "":  # given but empty (e.g. `train.run_name=$UNSET`): a mistake, not the default
            check_name(k, v)
        _set(cfg, k, v)
    return cfg


def _saved(d: dict) -> dict:
    """A config file or a saved config (a run's config.json, a checkpoint's meta) holds "" for a default name:
    there it means the default, while an override given as "" is refused (apply_overrides)."""
    return {k: v for k, v in flatten(d).items() if not (k in NAME_KEYS and v == "")}


def load_config(name_or_path: str, overrides: list[str] | dict | None = None,
                world_size: int = 1) -> RunConfig:
    """A preset name or a .toml/.json file (which may say `preset = "..."` to start from), then overrides.
    Validated before it is returned."""
    path = Path(name_or_path)
    if path.suffix in (".toml", ".json"):
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            raw = tomllib.loads(path.read_text()) if path.suffix == ".toml" else json.loads(path.read_text())
        except (ValueError, OSError) as e:  # tomllib.TOMLDecodeError and JSONDecodeError are ValueErrors
            raise ConfigError(f"config file {path} cannot be read ({e}); fix its syntax") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} holds a {type(raw).__name__}; it must be a table/object of "
                              "sections like {\"train\": {\"max_steps\": 100}}")
        cfg = preset(raw.pop("preset", "gpt2-124m"))
        cfg = apply_overrides(cfg, _saved(raw))
    else:
        cfg = preset(name_or_path)
    cfg = apply_overrides(cfg, overrides)
    return cfg.validate(world_size)


def as_config(cfg: RunConfig | dict, world_size: int = 1) -> RunConfig:
    """The config a flow resolved once, handed to a stage as `cfg.to_dict()` (Prefect records task
    parameters as JSON), back as a RunConfig validated for `world_size` processes. No stage resolves a
    preset and overrides again: what the flow decided is what every stage runs with."""
    return (cfg if isinstance(cfg, RunConfig) else from_dict(cfg)).validate(world_size)


def from_dict(d: dict) -> RunConfig:
    """Rebuild a RunConfig from `to_dict()` output (e.g. a checkpoint's meta.json)."""
    d = dict(d)
    cfg = RunConfig(preset=d.pop("preset", "gpt2-124m"))
    return apply_overrides(cfg, _saved(d))
