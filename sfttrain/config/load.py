"""Defaults <- YAML file <- `key=value` overrides, into a typed `Config`; every unknown key is a problem."""

from __future__ import annotations

from typing import Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError
from omegaconf.nodes import StringNode
from yaml import YAMLError, safe_load

from sfttrain.config.compat import ABSENT, ALIASES, unknown_key_problem, pop, translate
from sfttrain.config.problems import config_problems
from sfttrain.config.schema import Config
from sfttrain.errors import ConfigError

# keys whose value may be a dict of its own (checked where they are used)
FREE_FORM = ("model.fsdp_config.mixed_precision", "model.fsdp_config.wrap_policy")


def load_config(yaml_path: Optional[str] = None, overrides: tuple[str, ...] | list[str] = (),
                check: bool = True) -> Config:
    """The merged, resolved configuration, validated unless `check` is false (the start-up checks list its
    problems, those of the load among them: unknown keys, values of the wrong type and verl keys refused,
    `Config.load_problems`)."""
    layers, problems = [], []
    if yaml_path is not None:
        try:
            layers.append(OmegaConf.load(yaml_path))
        except FileNotFoundError:
            raise ConfigError(f"config file {yaml_path!r} does not exist") from None
        except YAMLError as e:  # the parser's problem and its line, without its multi-line context dump
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"config file {yaml_path!r} is not valid YAML: {getattr(e, 'problem', None) or e}"
                              f"{where}") from None
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides must look like key=value, got {bad}")
    merged = OmegaConf.structured(Config)
    layers.append(_dotlist(overrides, merged))
    try:
        for layer in layers:
            problems += translate(layer) + _drop_unknown_keys(layer, merged)
            while True:  # a value of the wrong type is one more problem, taken out so that the rest merges
                try:
                    merged = OmegaConf.merge(merged, layer)
                    break
                except ValidationError as e:
                    if not e.full_key or pop(layer, e.full_key) is ABSENT:
                        raise
                    problems.append(_value_problem(e))
        OmegaConf.resolve(merged)
        cfg: Config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(_value_problem(e)) from None
    cfg.load_problems = tuple(dict.fromkeys(problems))
    if check and (found := config_problems(cfg)):
        raise ConfigError("\n".join(found))
    return cfg


def _dotlist(overrides: tuple[str, ...] | list[str], schema: DictConfig) -> DictConfig:
    """`key=value` arguments as one layer (`+key`, `++key` alike); values are YAML, except a string
    key's unquoted text, kept as it is; one word for a list key is a list of one."""
    layer = OmegaConf.create()
    for item in overrides:
        key, _, text = item.partition("=")
        key = key.lstrip("+")
        try:
            value = safe_load(text)
        except YAMLError:
            value = text
        node = _schema_node(schema, ALIASES.get(key, key))
        if isinstance(node, StringNode) and value is not None and not (isinstance(value, str) and text[:1] in "'\""):
            value = text
        if isinstance(node, ListConfig) and isinstance(value, str):
            value = [value]
        OmegaConf.update(layer, key, value, force_add=True)
    return layer


def _schema_node(schema: DictConfig, key: str) -> Any:
    """The schema's node of a dotted key; None for a key it does not have."""
    node: Any = schema
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return None
        node = node._get_node(part)
    return node


def _flat_keys(node: Any, prefix: str = "") -> list[str]:
    if not isinstance(node, DictConfig):
        return [prefix]
    keys = []
    for k in node.keys():
        path = f"{prefix}.{k}" if prefix else str(k)
        keys.extend(_flat_keys(node._get_node(k), path))
    return keys


def _drop_unknown_keys(layer: DictConfig, schema: DictConfig) -> list[str]:
    """Every unknown key of the layer as a problem, with the key meant, taken out so that the rest loads."""
    known = set(_flat_keys(schema)) | set(ALIASES)
    unknown = [key for key in _flat_keys(layer)
               if key not in known and not any(key.startswith(k + ".") for k in FREE_FORM)]
    for key in unknown:  # from its first part the schema lacks (a section's keys: the section)
        parts = key.split(".")
        pop(layer, ".".join(next(parts[:i] for i in range(1, len(parts) + 1)
                                 if _schema_node(schema, ".".join(parts[:i])) is None)))
    return [unknown_key_problem(key, known) for key in unknown]


def _value_problem(e: OmegaConfBaseException) -> str:
    """omegaconf's message in one line, led by the key."""
    first_line = str(getattr(e, "msg", None) or e).splitlines()[0]
    key = getattr(e, "full_key", None)
    if not key:
        return f"bad config value: {first_line}"
    return f"bad value for {key}: {first_line}; see python -m sfttrain.run --help"


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
