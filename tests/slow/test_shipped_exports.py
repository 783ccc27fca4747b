"""Every draft shipped in the package, through `deepspec export --to vllm|sglang` and `deepspec check`.

Generic over `deepspec/shipped/`: a draft whose settings the engines can hold must export to both formats
(self-checked) and pass `deepspec check`; one they cannot must be refused (exit 3), nothing written, with
every setting to retrain with named.  The settings are read from the shipped config here, independently of
the exporters."""
import json
import shutil

import pytest

from deepspec.export.check import main as check_main
from deepspec.export.cli import main as export_main
from deepspec.paths import SHIPPED_DIR, SHIPPED_FOR_TARGET

pytestmark = pytest.mark.slow
TARGET_PATHS = {"smollm2_135m": "reference:smollm2-135m"}
SHIPPED = sorted(p.name for p in SHIPPED_DIR.iterdir() if (p / "config.json").is_file())


def fixes_for(cfg, stop_ids):
    """The `draft.*` settings an engine export of this draft needs that it was not trained with."""
    d = cfg["draft"]
    out = []
    if d.get("algorithm") == "eagle3" and d.get("eagle3_layout", "native") != "engine":
        out.append("draft.eagle3_layout=engine")
    for key, bad, fix in (("anchor_feature", True, "false"), ("embed_proj", True, "false")):
        if d.get(key) == bad:
            out.append(f"draft.{key}={fix}")
    if d.get("hidden_size") is not None:
        out.append("draft.hidden_size=null")
    if d.get("algorithm") != "eagle3":
        if d.get("confidence_head") and d.get("sequential_head", "none") == "none":
            out.append("draft.confidence_head=false")
        if int(cfg["mask_token_id"]) in stop_ids:
            out.append("draft.mask_token_id=")
    return out


@pytest.fixture(scope="module")
def tokens(reference_target_dir):
    """(stop token ids, the mask token id the target suggests) of the reference target."""
    from deepspec.config import TargetConfig
    from deepspec.targets import load_target
    from deepspec.targets.mask_token import suggested_mask_token, target_tokens
    inventory, rows, stop_ids = target_tokens(load_target(TargetConfig(path="reference:smollm2-135m", device="cpu")))
    return stop_ids, suggested_mask_token(inventory, rows, stop_ids)


def _target_args(cfg):
    name = cfg["target"].get("name")
    assert name in TARGET_PATHS, f"shipped draft for {name!r}: add its target path to TARGET_PATHS"
    return ["--target-path", TARGET_PATHS[name]]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_draft_exports_or_is_refused_with_the_settings_to_retrain_with(name, tmp_path, capsys, tokens):
    stops = tokens[0]
    src = SHIPPED_DIR / name
    cfg = json.loads((src / "config.json").read_text())
    for fmt in ("vllm", "sglang"):
        out = tmp_path / fmt
        rc = export_main(["--to", fmt, str(src), str(out), *_target_args(cfg)])
        err = capsys.readouterr().err
        fixes = fixes_for(cfg, stops)
        if fixes:
            assert rc == 3 and not out.exists(), (fmt, rc, err)
            named = err.split("Retrain with", 1)[1]
            assert all(f in named for f in fixes), (fmt, fixes, err)
        else:
            assert rc == 0, (fmt, err)
            assert check_main([str(out), *_target_args(cfg)]) == 0, capsys.readouterr().out


def test_a_shipped_draft_with_a_stop_token_mask_is_refused_naming_the_mask_to_use(tmp_path, capsys, tokens):
    """Whatever is shipped: a copy whose mask token is the end-of-turn token is refused for both engines."""
    stops, best = tokens
    assert best not in stops
    name = next(n for n in SHIPPED if json.loads((SHIPPED_DIR / n / "config.json").read_text())["architecture"]
                in ("dspark", "dflash"))
    src = tmp_path / name
    shutil.copytree(SHIPPED_DIR / name, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["mask_token_id"] = cfg["draft"]["mask_token_id"] = min(stops)
    (src / "config.json").write_text(json.dumps(cfg))
    for fmt in ("vllm", "sglang"):
        assert export_main(["--to", fmt, str(src), str(tmp_path / fmt), *_target_args(cfg)]) == 3
        err = capsys.readouterr().err
        assert f"draft.mask_token_id={min(stops)} — the mask token is a stop token" in err
        assert f"draft.mask_token_id={best}" in err.split("Retrain with", 1)[1]


def test_the_shipped_directory_maps_targets_it_knows():
    assert set(SHIPPED_FOR_TARGET.values()) <= set(SHIPPED)
