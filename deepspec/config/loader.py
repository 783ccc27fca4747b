"""Compose a typed config from `conf/`, a recipe and command-line overrides.

The dataclasses (`deepspec/config/<group>.py`) hold every default.  `conf/config.yaml`
holds the defaults list (one choice per group); each group file under `conf/<group>/`
states only what its variant changes and is validated against the matching dataclass,
so a misspelt key or a wrong type fails with the key's full name.  A recipe
(`recipes/<name>.yaml`) is an experiment: group choices plus the field values that
differ from them, applied before the user's own overrides.

`conf/` and `recipes/` sit at the repository root; the wheel maps them into the package
(`deepspec/conf`, `deepspec/recipes`; see `setup.py`), so an installed wheel finds them too.
`DEEPSPEC_CONF_DIR` / `DEEPSPEC_RECIPES_DIR` point elsewhere.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import typing
from pathlib import Path
from typing import Iterable, List, Sequence

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from .schema import DeepSpecConfig
from .typed import ConfigError, build, omegaconf_schema

log = logging.getLogger(__name__)
GROUPS = ("target", "draft", "data", "cache", "train", "eval", "schedule", "engine")


PACKAGE_DIR = Path(__file__).resolve().parents[1]


def project_root() -> Path:
    """The directory above the package: the repository root in a source checkout."""
    return PACKAGE_DIR.parent


def _data_dir(name: str) -> Path:
    """`<repo>/<name>` in a source checkout (editable install), `deepspec/<name>` in a wheel."""
    checkout = project_root() / name
    if (project_root() / "pyproject.toml").is_file() and checkout.is_dir():
        return checkout
    return PACKAGE_DIR / name


def conf_dir() -> Path:
    return Path(os.environ.get("DEEPSPEC_CONF_DIR", _data_dir("conf"))).resolve()


def recipes_dir() -> Path:
    return Path(os.environ.get("DEEPSPEC_RECIPES_DIR", _data_dir("recipes"))).resolve()


def list_recipes() -> List[str]:
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def _register_schema() -> None:
    ConfigStore.instance().store(name="deepspec_schema", node=omegaconf_schema(DeepSpecConfig))


def _flatten(prefix: str, node) -> Iterable[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _flatten(f"{prefix}.{k}" if prefix else str(k), v)
    else:
        yield f"{prefix}={_override_value(node)}"


def _override_value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_override_value(x) for x in v) + "]"
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return str(v)


def recipe_overrides(name: str) -> List[str]:
    """Turn `recipes/<name>.yaml` into Hydra override strings."""
    path = Path(name) if name.endswith(".yaml") else recipes_dir() / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown recipe {name!r}: no file {path} "
                          f"(available: {', '.join(list_recipes()) or 'none'})")
    doc = yaml.safe_load(path.read_text()) or {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping")
    out: List[str] = []
    for group, choice in (doc.pop("defaults", None) or {}).items():
        if group not in GROUPS:
            raise ConfigError(f"{path}: defaults.{group} is not a config group ({', '.join(GROUPS)})")
        out.append(f"{group}={choice}")
    out.append(f"recipe={_override_value(path.stem)}")
    out.extend(_flatten("", doc))
    return out


def _split_recipe(overrides: Sequence[str]):
    recipe, rest = None, []
    for o in overrides:
        if o.startswith("recipe="):
            recipe = o.split("=", 1)[1]
        else:
            rest.append(o)
    return recipe, rest


def compose_config(overrides: Sequence[str] = (), config_name: str = "config") -> DictConfig:
    """Compose the raw (validated) OmegaConf config."""
    recipe, rest = _split_recipe(list(overrides))
    all_overrides = (recipe_overrides(recipe) if recipe else []) + rest
    _register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
            cfg = compose(config_name=config_name, overrides=all_overrides)
    except Exception as e:  # hydra raises several types; re-raise with context
        cause = f" ({e.__cause__})" if e.__cause__ is not None else ""
        raise ConfigError(f"cannot compose config from {conf_dir()}: {e}{cause}") from e
    finally:
        GlobalHydra.instance().clear()
    check_keys(OmegaConf.to_container(cfg, resolve=False), DeepSpecConfig)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(omegaconf_schema(DeepSpecConfig)), cfg)
    except Exception as e:
        raise ConfigError(str(e)) from e
    OmegaConf.set_readonly(merged, False)
    build(DeepSpecConfig, OmegaConf.to_container(merged, resolve=True))   # every enumerated key checked now
    return merged


def check_keys(node, schema, prefix: str = "") -> None:
    """Refuse keys the dataclass schema does not declare (Hydra's `+key=` bypasses struct mode)."""
    if not isinstance(node, dict) or not dataclasses.is_dataclass(schema):
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    for key, value in node.items():
        name = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(f"unknown config key {name!r} (known under {prefix or 'the root'}: "
                              f"{', '.join(sorted(fields))})")
        sub = hints.get(key)
        if dataclasses.is_dataclass(sub):
            check_keys(value, sub, name + ".")


def load_config(overrides: Sequence[str] = ()) -> DeepSpecConfig:
    """Compose and convert to the typed dataclass tree."""
    return to_object(compose_config(overrides))


def to_object(cfg) -> DeepSpecConfig:
    """The typed config of a composed node (or of a plain mapping of its values)."""
    if isinstance(cfg, DeepSpecConfig):
        return cfg
    try:
        node = OmegaConf.merge(OmegaConf.structured(omegaconf_schema(DeepSpecConfig)), cfg)
    except Exception as e:
        raise ConfigError(str(e)) from e
    return build(DeepSpecConfig, OmegaConf.to_container(node, resolve=True))


def as_node(cfg) -> DictConfig:
    """A typed config (any section's dataclass) as a structured OmegaConf node."""
    if isinstance(cfg, DictConfig):
        return cfg
    return OmegaConf.merge(OmegaConf.structured(omegaconf_schema(type(cfg))), dataclasses.asdict(cfg))


def with_overrides(cfg, dotlist: Sequence[str]) -> DeepSpecConfig:
    """``cfg`` with ``key=value`` overrides applied, validated like a composed config."""
    check_keys(OmegaConf.to_container(OmegaConf.from_dotlist(list(dotlist))), DeepSpecConfig)
    return to_object(OmegaConf.merge(as_node(cfg), OmegaConf.from_dotlist(list(dotlist))))


def to_yaml(cfg) -> str:
    return OmegaConf.to_yaml(as_node(cfg), resolve=True)


def save_config(cfg, out_dir: str | os.PathLike, name: str = "resolved_config.yaml") -> Path:
    """Write the resolved config beside a run's outputs (atomically)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(to_yaml(cfg))
    os.replace(tmp, path)
    return path


# Keys that resolved configs written by earlier versions may hold, and what replaced them.  Reading such a
# config (a run's run.yaml, to evaluate or export its checkpoints) drops them, with a warning where they held
# a value; composing a new config with one is an unknown-key error as usual.
REMOVED_KEYS = {"eval.confidence_threshold": "schedule.policy=threshold and schedule.threshold",
                "train.heldout_fraction": "data.heldout_fraction (one split, by sample id)",
                "train.max_length": "data.max_length"}


def _drop_removed(doc: dict, path) -> None:
    for dotted, replacement in REMOVED_KEYS.items():
        section, key = dotted.split(".")
        node = doc.get(section)
        if isinstance(node, dict) and key in node:
            value = node.pop(key)
            if value is not None:
                log.warning("%s: %s=%r is no longer a key (now %s); ignored", path, dotted, value, replacement)


def config_from_yaml(path: str | os.PathLike) -> DeepSpecConfig:
    """Re-load a resolved config written by `save_config` (validated)."""
    raw = OmegaConf.to_container(OmegaConf.load(str(path)))
    try:
        _drop_removed(raw, path)
        check_keys(raw, DeepSpecConfig)
        return to_object(OmegaConf.create(raw))
    except Exception as e:
        raise ConfigError(f"{path}: {e}") from e
