import pytest

from deepspec.config import ConfigError, config_from_yaml, list_recipes, load_config, save_config


def test_defaults_compose_typed():
    cfg = load_config([])
    assert cfg.draft.algorithm == "dspark" and cfg.draft.gamma == 7
    assert cfg.target.name == "smollm2_135m"
    assert isinstance(cfg.train.lr, float)


def test_group_choice_and_field_override():
    cfg = load_config(["draft=eagle3", "target=qwen3_4b", "train.lr=3e-4"])
    assert cfg.draft.algorithm == "eagle3" and cfg.draft.num_layers == 1
    assert cfg.target.layer_ids == [1, 9, 17, 25, 33]
    assert cfg.train.lr == pytest.approx(3e-4)


@pytest.mark.parametrize("override,needle", [
    ("train.lrr=1", "train.lrr"),
    ("+train.lrr=1", "train.lrr"),
    ("+nonsense=1", "nonsense"),
    ("train.lr=abc", "train.lr"),
    ("draft.gamma=seven", "draft.gamma"),
    ("target=no_such_target", "target/no_such_target"),
])
def test_unknown_keys_and_wrong_types_name_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config([override])
    assert needle in str(e.value)


def test_recipes_select_by_name_and_user_overrides_win():
    names = list_recipes()
    for algo in ("dspark", "dflash", "eagle3"):
        for t in ("qwen3_4b", "qwen3_8b", "qwen3_14b", "gemma3_12b"):
            assert f"{algo}_{t}" in names
    cfg = load_config(["recipe=eagle3_smollm2_cpu", "train.lr=1e-3"])
    assert cfg.recipe == "eagle3_smollm2_cpu"
    assert cfg.draft.algorithm == "eagle3" and cfg.train.lr == pytest.approx(1e-3)
    with pytest.raises(ConfigError, match="unknown recipe"):
        load_config(["recipe=nope"])


def test_every_recipe_composes():
    for name in list_recipes():
        cfg = load_config([f"recipe={name}"])
        assert cfg.recipe == name


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(["draft=dflash", "seed=7"])
    path = save_config(cfg, tmp_path)
    again = config_from_yaml(path)
    assert again == cfg
    path.write_text(path.read_text().replace("seed: 7", "seed: 7\nbogus: 1"))
    with pytest.raises(ConfigError, match="bogus"):
        config_from_yaml(path)


def _leaves(node, prefix=""):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, node


def test_yaml_states_only_what_differs_from_the_defaults():
    """One source of truth: a group file sets only keys its dataclass defaults differently, a
    recipe only keys its chosen groups compose differently."""
    import dataclasses

    import yaml
    from omegaconf import OmegaConf

    from deepspec.config.loader import GROUPS, compose_config, conf_dir, recipes_dir
    from deepspec.config.schema import DeepSpecConfig

    defaults = dataclasses.asdict(DeepSpecConfig())
    for group in GROUPS:
        for path in sorted((conf_dir() / group).glob("*.yaml")):
            text = path.read_text()
            root = text.startswith("# @package _global_")         # keys from the root (draft.*, target.*)
            for key, value in _leaves(yaml.safe_load(text) or {}):
                default = defaults if root else defaults[group]
                for part in key.split("."):
                    default = default[part]
                assert value != default, f"{path}: {key} repeats the dataclass default {default!r}"
    for path in sorted(recipes_dir().glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        choices = doc.pop("defaults")
        assert {"target", "draft"} <= set(choices), f"{path}: a recipe names its target and draft"
        base = OmegaConf.to_container(compose_config([f"{g}={c}" for g, c in choices.items()]))
        for key, value in _leaves(doc):
            composed = base
            for part in key.split("."):
                composed = composed[part]
            assert value != composed, f"{path}: {key} repeats what its groups compose ({composed!r})"


def _literal_keys(cls, prefix=""):
    import dataclasses
    import typing
    from deepspec.config.typed import choices
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _literal_keys(hints[f.name], f"{prefix}{f.name}.")
        elif choices(hints[f.name]) is not None:
            yield f"{prefix}{f.name}", choices(hints[f.name])


def test_every_enumerated_key_is_checked_when_the_config_loads():
    from deepspec.config import ConfigError, DeepSpecConfig, load_config
    keys = dict(_literal_keys(DeepSpecConfig))
    assert {"draft.sequential_head", "train.strategy", "cache.codec", "target.dtype"} <= set(keys)
    for key, allowed in keys.items():
        with pytest.raises(ConfigError, match=rf"{key}='no_such_choice': choose from "):
            load_config([f"{key}=no_such_choice"])
        good = next(a for a in allowed if a is not None)
        assert load_config([f"{key}={good}"]) is not None


def test_typed_config_round_trips_through_yaml_and_overrides(tmp_path):
    from deepspec.config import config_from_yaml, load_config, save_config, with_overrides
    cfg = load_config(["draft=dspark_rnn", "train.strategy=fsdp"])
    again = config_from_yaml(save_config(cfg, tmp_path))
    assert again == cfg and again.draft.sequential_head == "rnn"
    assert with_overrides(cfg, ["cache.codec=fp8"]).cache.codec == "fp8"


def test_resolved_configs_of_earlier_versions_drop_removed_keys(tmp_path, caplog):
    from deepspec.config import config_from_yaml, load_config, save_config
    path = save_config(load_config([]), tmp_path)
    text = path.read_text().replace("\neval:\n", "\neval:\n  confidence_threshold: null\n")
    text = text.replace("\ntrain:\n", "\ntrain:\n  heldout_fraction: 0.05\n  max_length: 1024\n")
    path.write_text(text)
    assert config_from_yaml(path) == load_config([])
    assert "train.heldout_fraction=0.05 is no longer a key" in caplog.text
    assert "confidence_threshold" not in caplog.text              # it held no value: nothing to say
    with pytest.raises(ConfigError, match="eval.confidence_threshold"):
        load_config(["eval.confidence_threshold=0.5"])            # a new config with it is still an error
