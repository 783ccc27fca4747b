"""tools/ship_draft.py on a 2-step tiny run: the shipped draft loads, holds the checkpoint's weights cast to
bf16, carries the run's provenance and held-out numbers, and the tool refuses what it must without
leaving anything behind."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools import ship_draft  # noqa: E402

REQUIRED = ("name", "target", "shipped", "commit", "command", "run_dir", "checkpoint", "steps", "config", "data",
            "machine", "weights_dtype", "heldout", "heldout_curve", "heldout_split", "eval_check", "calibration")


def _overrides(tmp: Path):
    kw = {"run_dir": tmp / "run", "target.path": "tiny:llama", "target.dtype": "float32", "target.device": "cpu",
          "target.num_feature_layers": 2, "draft.num_layers": 1, "draft.gamma": 3, "draft.head_rank": 16,
          "draft.vocab_size": 128, "data.regen_path": tmp / "regen.jsonl", "data.max_length": 96,
          "cache.dir": tmp / "cache", "cache.shard_samples": 8, "train.strategy": "single",
          "train.global_batch_sequences": 4, "train.micro_batch_sequences": 2, "train.anchors_per_sequence": 6,
          "train.max_steps": 2, "train.save_every": 1, "train.eval_every": 1, "data.heldout_fraction": 0.2,
          "train.bf16": "false", "train.keep_last": 0, "train.tensorboard": "false"}
    return [f"{k}={v}" for k, v in kw.items()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A cache of 20 synthetic conversations and 2 training steps on it (checkpoint and held-out eval each step)."""
    from deepspec.config import load_config
    from deepspec.cache.writer import build_cache
    from tests.support.synthetic import write_regen_jsonl
    from deepspec.targets import load_target
    from deepspec.train.loop import run as train
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("ship")
    write_regen_jsonl(tmp / "regen.jsonl", 20, seed=3, max_words=40)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPSPEC_NO_PROGRESS", "1")
        cfg = load_config(_overrides(tmp))
        target = load_target(cfg.target)
        build_cache(cfg, target=target, progress=False)
        train(cfg)
    yield tmp, tmp / "run", target
    torch.set_num_threads(n)


def _ship(run_dir, root, *extra, name="tiny-dspark"):
    return ship_draft.main(["--run-dir", str(run_dir), "--name", name, "--command", "deepspec train (2 tiny steps)",
                            "--data-note", "20 synthetic conversations", "--preparation", "write_regen_jsonl",
                            "build_cache", "--shipped-root", str(root), *extra])


def _eval_rows(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if any(k.startswith("eval/") for k in r)]


def test_shipped_draft_loads_with_the_checkpoints_bf16_weights_and_provenance(run, tmp_path, capsys):
    from deepspec.cache import CacheReader
    from deepspec.drafts import load_drafter
    _, run_dir, target = run
    root = tmp_path / "shipped"
    assert _ship(run_dir, root) == 0, capsys.readouterr().err
    out = root / "tiny-dspark"
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors", "provenance.json"]
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in out.iterdir()) and out.stat().st_mode & 0o777 == 0o755

    ck = run_dir / "checkpoints" / "step_2"              # the newest complete checkpoint
    want, got = load_file(str(ck / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert got.keys() == want.keys() and "draft_vocab" in got
    for k, v in want.items():
        cast = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert got[k].dtype == cast.dtype and torch.equal(got[k], cast), k
    drafter = load_drafter(out, target)
    for k, v in drafter.state_dict().items():
        assert torch.equal(v.to(got[k].dtype), got[k]), k

    prov = json.loads((out / "provenance.json").read_text())
    assert all(k in prov for k in REQUIRED), sorted(set(REQUIRED) - set(prov))
    rows = _eval_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert prov["heldout"] == rows[-1] and prov["heldout"]["eval/expected_tau"] >= 1.0
    assert prov["heldout_curve"] == [{k: r[k] for k in ("step", "eval/expected_tau", "eval/accept_rate/1")}
                                     for r in rows]
    assert (prov["checkpoint"], prov["steps"], prov["weights_dtype"]) == ("step_2", 2, "bfloat16")
    assert prov["config"] == json.loads((ck / "config.json").read_text())["draft"]
    assert prov["command"] == "deepspec train (2 tiny steps)" and prov["eval_check"] is None
    assert "--shipped-root" in prov["ship_command"] and len(prov["commit"]) == 40
    st = CacheReader(run[0] / "cache").stats()
    assert (prov["data"]["conversations"], prov["data"]["tokens"], prov["data"]["answer_tokens"]) == \
           (st["samples"], st["tokens"], st["loss_tokens"])
    assert prov["data"]["preparation"] == ["write_regen_jsonl", "build_cache"]
    # the held-out count agrees with the trainer's own banner
    held = re.findall(r"(\d+) held-out sequences", (run_dir / "train.log").read_text())[-1]
    assert prov["heldout_split"].endswith(f": {held} sequences")

    card = (out / "README.md").read_text()
    assert card.startswith("# tiny-dspark\n") and f"E[τ] {rows[-1]['eval/expected_tau']:.3f}" in card
    assert f"on {held} held-out sequences" in card and "tools/ship_draft.py" in card
    assert "no decoding check recorded" in card


def test_an_earlier_checkpoint_ships_with_its_own_numbers(run, tmp_path):
    _, run_dir, _ = run
    root = tmp_path / "shipped"
    assert _ship(run_dir, root, "--checkpoint", "step_1") == 0
    prov = json.loads((root / "tiny-dspark" / "provenance.json").read_text())
    assert (prov["checkpoint"], prov["steps"]) == ("step_1", 1)
    assert prov["heldout"] == _eval_rows(run_dir)[0] and [r["step"] for r in prov["heldout_curve"]] == [1]
    want = load_file(str(run_dir / "checkpoints" / "step_1" / "model.safetensors"))
    got = load_file(str(root / "tiny-dspark" / "model.safetensors"))
    assert all(torch.equal(got[k], v.to(got[k].dtype)) for k, v in want.items())


def test_replacing_a_shipped_draft_leaves_no_temp_dirs(run, tmp_path):
    _, run_dir, _ = run
    root = tmp_path / "shipped"
    (root / "other").mkdir(parents=True)
    (root / "other" / "model.safetensors").write_bytes(b"x" * 1000)
    assert _ship(run_dir, root, "--checkpoint", "step_1") == 0
    stale = root / ".tiny-dspark.ship-killed"                # what a ship killed mid-way leaves
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    assert _ship(run_dir, root) == 0
    assert sorted(p.name for p in root.iterdir()) == ["other", "tiny-dspark"]
    assert json.loads((root / "tiny-dspark" / "provenance.json").read_text())["checkpoint"] == "step_2"


def test_refusals_name_the_file_and_change_nothing(run, tmp_path, capsys):
    _, run_dir, _ = run
    root = tmp_path / "shipped"
    assert _ship(run_dir, root) == 0
    before = {p.name: p.read_bytes() for p in (root / "tiny-dspark").iterdir()}
    capsys.readouterr()

    # over budget: the other files plus the new draft exceed it; the shipped draft stays as it was
    assert _ship(run_dir, root, "--checkpoint", "step_1", "--budget-mb", "0.01") == 2
    err = capsys.readouterr().err
    assert str(root / "tiny-dspark" / "model.safetensors") in err and "0.01 MB budget" in err
    assert {p.name: p.read_bytes() for p in (root / "tiny-dspark").iterdir()} == before
    assert sorted(p.name for p in root.iterdir()) == ["tiny-dspark"]

    for bad in ("../escape", "a/b", ".", "..", ".hidden", ""):
        assert _ship(run_dir, root, name=bad) == 2
        assert "not a plain directory name" in capsys.readouterr().err
    assert sorted(p.name for p in root.iterdir()) == ["tiny-dspark"] and not (tmp_path / "escape").exists()

    empty = tmp_path / "empty_run"
    (empty / "checkpoints" / "step_3.tmp").mkdir(parents=True)   # a half-written checkpoint is not one
    assert _ship(empty, root) == 2
    assert f"{empty / 'checkpoints'}: no complete checkpoint" in capsys.readouterr().err
    assert _ship(run_dir, root, "--checkpoint", "step_7") == 2
    assert "step_7: not a complete checkpoint (complete ones: step_1, step_2)" in capsys.readouterr().err


@pytest.fixture(scope="module")
def eval_results(run, eval_data_dir):
    """A greedy `deepspec eval` of step_2 (one gsm8k prompt, 8 new tokens)."""
    from deepspec.config import config_from_yaml, with_overrides
    from deepspec.eval.runner import run as evaluate
    tmp, run_dir, _ = run
    cfg = config_from_yaml(run_dir / "run.yaml")
    dots = [f"eval.checkpoint={run_dir / 'checkpoints' / 'step_2'}", f"eval.out_dir={tmp / 'eval'}",
            f"eval.data_dir={eval_data_dir}", "eval.benchmarks=[gsm8k]", "eval.max_samples=1",
            "eval.max_new_tokens=8", "eval.temperature=0", "eval.decoding=chain", "eval.progress=false",
            "eval.warmup=false"]
    evaluate(with_overrides(cfg, dots))
    return tmp / "eval" / "results.json"


def test_eval_check_records_greedy_tau_and_refuses_another_checkpoints_eval(run, eval_results, tmp_path, capsys):
    _, run_dir, _ = run
    res = json.loads(eval_results.read_text())
    root = tmp_path / "shipped"
    assert _ship(run_dir, root, "--eval-check", str(eval_results)) == 0
    check = json.loads((root / "tiny-dspark" / "provenance.json").read_text())["eval_check"]
    gc = res["greedy_check"]
    assert gc["matched"] == gc["compared"] == 1
    assert check["greedy_identical_to_target"] == f"{gc['matched']}/{gc['compared']}"
    assert check["tau_greedy"] == res["overall"]["tau"] >= 1.0 and check["prompts"] == res["overall"]["requests"] == 1
    assert check["benchmarks"] == ["gsm8k"] and check["max_new_tokens"] == 8
    assert check["evaluated"] == "checkpoint step_2 in float32, before the bf16 cast"
    assert (check["dtype"], check["policy"]) == (res["setup"]["dtype"], "fixed") == ("torch.float32", "fixed")
    card = (root / "tiny-dspark" / "README.md").read_text()
    assert f"greedy τ {res['overall']['tau']:.2f} on 1 prompt (gsm8k" in card
    assert "(target float32, fixed verification)" in card
    capsys.readouterr()
    # the eval decoded step_2: it is no check of step_1
    assert _ship(run_dir, root, "--checkpoint", "step_1", "--eval-check", str(eval_results)) == 2
    assert f"{eval_results}: evaluated" in capsys.readouterr().err
    assert json.loads((root / "tiny-dspark" / "provenance.json").read_text())["checkpoint"] == "step_2"


def test_eval_of_the_shipped_bf16_weights_is_a_check_of_them(run, eval_data_dir, tmp_path):
    from deepspec.config import config_from_yaml, with_overrides
    from deepspec.eval.runner import run as evaluate
    _, run_dir, _ = run
    root = tmp_path / "shipped"
    assert _ship(run_dir, root) == 0
    dots = [f"eval.checkpoint={root / 'tiny-dspark'}", f"eval.out_dir={tmp_path / 'eval'}",
            f"eval.data_dir={eval_data_dir}", "eval.benchmarks=[gsm8k]", "eval.max_samples=1",
            "eval.max_new_tokens=8", "eval.temperature=0", "eval.decoding=chain", "eval.progress=false",
            "eval.warmup=false"]
    cfg = config_from_yaml(run_dir / "run.yaml")
    evaluate(with_overrides(cfg, dots))
    assert _ship(run_dir, root, "--eval-check", str(tmp_path / "eval" / "results.json")) == 0
    check = json.loads((root / "tiny-dspark" / "provenance.json").read_text())["eval_check"]
    assert check["evaluated"] == "these bfloat16 weights" and check["greedy_identical_to_target"] == "1/1"


def test_an_online_run_reports_the_same_data_as_the_cache_of_its_conversations(run, tmp_path):
    from deepspec.config import load_config
    from deepspec.train.loop import run as train
    tmp, cached_run, _ = run
    online = tmp_path / "online"
    over = [o for o in _overrides(tmp) if not o.startswith(("run_dir=", "cache.dir=", "train.max_steps="))]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPSPEC_NO_PROGRESS", "1")
        train(load_config([*over, f"run_dir={online}", "data.online=true", "train.max_steps=1"]))
    root = tmp_path / "shipped"
    assert _ship(online, root) == 0
    prov = json.loads((root / "tiny-dspark" / "provenance.json").read_text())
    assert _ship(cached_run, tmp_path / "shipped_cached") == 0
    ref = json.loads((tmp_path / "shipped_cached" / "tiny-dspark" / "provenance.json").read_text())
    keys = ("conversations", "tokens", "answer_tokens")
    assert [prov["data"][k] for k in keys] == [ref["data"][k] for k in keys]
    assert "of the online data" in prov["heldout_split"] and "regen_sha256" not in prov["data"]
    assert prov["heldout_split"].split(": ")[-1] == ref["heldout_split"].split(": ")[-1]
    assert (prov["checkpoint"], [r["step"] for r in prov["heldout_curve"]]) == ("step_1", [1])


def test_a_calibration_fitted_on_the_drafts_rollouts_ships_beside_it(run, eval_results, tmp_path, capsys):
    from deepspec.config import config_from_yaml, with_overrides
    from deepspec.drafts import load_drafter
    from deepspec.schedule.calibrate import run as calibrate
    from deepspec.schedule.calibration import Calibration, find_calibration
    from deepspec.schedule.rollouts import synthetic_rollouts, write_rollouts
    tmp, run_dir, target = run
    rollouts = eval_results.parent / "rollouts.jsonl"
    cfg = config_from_yaml(run_dir / "run.yaml")
    dots = [f"schedule.rollouts={rollouts}", f"eval.out_dir={tmp_path / 'cal'}"]
    calibrate(with_overrides(cfg, dots))
    fitted = tmp_path / "cal" / "calibration" / "calibration.json"
    root = tmp_path / "shipped"
    assert _ship(run_dir, root, "--calibration", str(fitted)) == 0, capsys.readouterr().err
    out = root / "tiny-dspark"
    assert (out / "calibration.json").read_bytes() == fitted.read_bytes()
    assert find_calibration(out).temperatures == Calibration.load(fitted).temperatures   # where policies look
    load_drafter(out, target)                                                            # still a loadable draft
    rec = json.loads((out / "provenance.json").read_text())["calibration"]
    assert rec["rollouts"] == str(rollouts) and rec["rounds"] == Calibration.load(fitted).n_rounds > 0
    assert len(rec["temperatures"]) == 3 and "calibration.json" in (out / "README.md").read_text()
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()

    # refused, changing nothing: another γ, synthetic rollouts, not a calibration file
    other = Calibration.load(fitted)
    other.gamma, other.temperatures = 5, [1.0] * 5
    other.save(tmp_path / "g5.json")
    assert _ship(run_dir, root, "--calibration", str(tmp_path / "g5.json")) == 2
    assert f"{tmp_path / 'g5.json'}: calibrated for γ = 5" in capsys.readouterr().err
    write_rollouts(tmp_path / "syn.jsonl", synthetic_rollouts(n_requests=4, gamma=3, seed=0))
    calibrate(with_overrides(cfg, [f"schedule.rollouts={tmp_path / 'syn.jsonl'}", f"eval.out_dir={tmp_path / 'syn'}"]))
    assert _ship(run_dir, root, "--calibration", str(tmp_path / "syn" / "calibration")) == 2
    assert "synthetic rollouts" in capsys.readouterr().err
    (tmp_path / "junk.json").write_text("[1, 2]")
    assert _ship(run_dir, root, "--calibration", str(tmp_path / "junk.json")) == 2
    assert f"{tmp_path / 'junk.json'}: not a calibration.json" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_run_on_a_union_of_caches_reports_the_data_of_all_of_them(run, tmp_path, capsys):
    from deepspec.config import load_config
    from deepspec.cache.writer import build_cache
    from deepspec.train.loop import run as train
    tmp, cached_run, target = run
    lines = (tmp / "regen.jsonl").read_text().splitlines(keepends=True)
    over = [o for o in _overrides(tmp) if not o.startswith(("run_dir=", "cache.dir=", "data.regen_path="))]
    for name, part in (("a", lines[:12]), ("b", lines[12:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(part))
        build_cache(load_config([*over, f"run_dir={tmp_path / name}", f"data.regen_path={tmp_path / name}.jsonl",
                                 f"cache.dir={tmp_path / name / 'cache'}"]), target=target, progress=False)
    union = tmp_path / "union"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPSPEC_NO_PROGRESS", "1")
        train(load_config([*over, f"run_dir={union}", f"cache.dir={tmp_path / 'a' / 'cache'}",
                           f"cache.extra_dirs=[{tmp_path / 'b' / 'cache'}]"]))
    assert _ship(union, tmp_path / "shipped") == 0, capsys.readouterr().err
    prov = json.loads((tmp_path / "shipped" / "tiny-dspark" / "provenance.json").read_text())
    assert _ship(cached_run, tmp_path / "shipped_cached") == 0
    ref = json.loads((tmp_path / "shipped_cached" / "tiny-dspark" / "provenance.json").read_text())
    keys = ("conversations", "tokens", "answer_tokens")
    assert [prov["data"][k] for k in keys] == [ref["data"][k] for k in keys]
    assert len(prov["data"]["regen_sha256"]) == 2 and "of the union of 2 caches" in prov["heldout_split"]
    assert prov["heldout_split"].split(": ")[-1] == ref["heldout_split"].split(": ")[-1]
    (tmp_path / "b" / "cache").rename(tmp_path / "b" / "moved")
    assert _ship(union, tmp_path / "shipped2") != 0
    assert "cache.extra_dirs[0] in run.yaml" in capsys.readouterr().err and not (tmp_path / "shipped2").exists()
