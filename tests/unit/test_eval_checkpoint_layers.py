"""`deepspec eval` reads the target layers a checkpoint was trained on when target.layer_ids is unset (an Eagle3
over 3 layers evaluates with the target group's 5-layer default config); ids set otherwise stay an error."""
import json

import yaml

from deepspec import cli
from deepspec.config import load_config

TINY = ["target.path=tiny:llama", "target.dtype=float32", "target.device=cpu"]


def _draft(tmp_path, ids):
    from deepspec.drafts import build_drafter
    from deepspec.targets import load_target
    cfg = load_config([*TINY, "draft=eagle3", f"target.layer_ids=[{','.join(map(str, ids))}]"])
    out = tmp_path / "draft"
    build_drafter(load_target(cfg.target), cfg.draft).save_pretrained(out)
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "gsm8k.jsonl").write_text(json.dumps({"turns": ["1 + 1?"]}) + "\n")
    return out, [f"eval.data_dir={bench}", "eval.benchmarks=[gsm8k]", "eval.max_new_tokens=4",
                 "eval.measure_baseline=false", "eval.progress=false", f"eval.out_dir={tmp_path / 'ev'}"]


def test_eval_adopts_the_checkpoints_layers(tmp_path, capsys, one_thread):
    ckpt, ev = _draft(tmp_path, [0, 1])
    assert load_config(TINY).target.layer_ids is None          # the group's default would be other ids
    assert cli.main(["eval", *TINY, f"eval.checkpoint={ckpt}", *ev]) == 0
    saved = yaml.safe_load((tmp_path / "ev" / "resolved_config.yaml").read_text())
    assert saved["target"]["layer_ids"] == [0, 1]
    assert json.loads((tmp_path / "ev" / "results.json").read_text())["overall"]["tau"] >= 1
    # ids the user sets are kept, and a draft trained on others is refused, naming the key
    capsys.readouterr()
    assert cli.main(["eval", *TINY, "target.layer_ids=[0,1,2]", f"eval.checkpoint={ckpt}", *ev, "eval.rerun=true"]) == 1
    err = capsys.readouterr().err
    assert "target layer_ids is [0, 1, 2] but the draft was saved with [0, 1]" in err
