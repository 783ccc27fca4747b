"""Known errors reach the user as one line naming the file, line or key, with exit status 1 (data,
files) or 2 (config); the traceback only with --debug or DEEPSPEC_DEBUG=1."""
import json

import pytest

from deepspec import cli
from deepspec.cache import CacheCorruptError
from deepspec.config import ConfigError, load_config
from deepspec.data import DataError
from deepspec.drafts import DraftCheckpointError, DraftTargetMismatchError
from deepspec.errors import DeepSpecError
from deepspec.train.checkpoint import CheckpointError

TINY = ["target.path=tiny:llama", "target.dtype=float32", "target.device=cpu"]


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch, one_thread):
    monkeypatch.delenv("DEEPSPEC_DEBUG", raising=False)


def _run(capsys, *argv):
    capsys.readouterr()
    code = cli.main(list(argv))
    return code, capsys.readouterr().err


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def _bad_jsonl(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"turns": ["hi"]}\n{bad json\n')
    return path


def test_data_error_in_prepare(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["prepare", "data=jsonl", "data.path=bad.jsonl", *TINY, f"run_dir={tmp_path / 'run'}"]
    _bad_jsonl(tmp_path)
    code, err = _run(capsys, *argv)
    assert code == 1
    assert _one_line(err).startswith("deepspec prepare: data error: bad.jsonl:2: invalid JSON")
    code, err = _run(capsys, "--debug", *argv)
    assert code == 1 and "Traceback" in err
    assert err.strip().splitlines()[-1].startswith("deepspec prepare: data error: bad.jsonl:2")


def test_config_error_exits_2(capsys, monkeypatch):
    code, err = _run(capsys, "train", "train.lrr=1")
    assert code == 2 and _one_line(err).startswith("deepspec train: config error:") and "train.lrr" in err
    code, err = _run(capsys, "config", "recipe=nope")
    assert code == 2 and "unknown recipe 'nope'" in _one_line(err)
    monkeypatch.setenv("DEEPSPEC_DEBUG", "1")
    code, err = _run(capsys, "train", "train.lrr=1")
    assert code == 2 and "Traceback" in err and "config error" in err.strip().splitlines()[-1]


def test_corrupt_cache_in_train(tmp_path, capsys):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "manifest.json").write_text('{"format": ')
    code, err = _run(capsys, "train", *TINY, f"run_dir={tmp_path / 'run'}", f"cache.dir={cache}",
                     "train.strategy=single", "train.max_steps=1")
    assert code == 1
    line = _one_line(err)
    assert line.startswith("deepspec train: cache corrupt error:") and "manifest.json" in line


@pytest.fixture
def draft_for_llama(tmp_path):
    from deepspec.drafts import build_drafter
    from deepspec.targets import load_target
    cfg = load_config([*TINY, "draft.num_layers=1"])
    out = tmp_path / "draft"
    build_drafter(load_target(cfg.target), cfg.draft).save_pretrained(out)
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "gsm8k.jsonl").write_text(json.dumps({"turns": ["1 + 1?"]}) + "\n")
    return out, [f"eval.data_dir={bench}", "eval.benchmarks=[gsm8k]", f"run_dir={tmp_path / 'run'}"]


def test_checkpoint_target_mismatch_in_eval(draft_for_llama, capsys):
    ckpt, ev = draft_for_llama
    code, err = _run(capsys, "eval", "target.path=tiny:qwen3", "target.dtype=float32", f"eval.checkpoint={ckpt}", *ev)
    assert code == 1
    line = _one_line(err)
    assert line.startswith("deepspec eval: draft target mismatch error:") and str(ckpt) in line


def test_unreadable_draft_checkpoint_in_eval(draft_for_llama, capsys):
    ckpt, ev = draft_for_llama
    (ckpt / "config.json").write_text("{not json")
    code, err = _run(capsys, "eval", *TINY, f"eval.checkpoint={ckpt}", *ev)
    assert code == 1
    line = _one_line(err)
    assert line.startswith("deepspec eval: draft checkpoint error:") and "config.json" in line


def test_missing_input_file(tmp_path, capsys):
    code, err = _run(capsys, "eval", f"eval.data_dir={tmp_path}", "eval.benchmarks=[gsm8k]", f"run_dir={tmp_path}")
    assert code == 1 and "gsm8k" in _one_line(err)


@pytest.mark.parametrize("error,code", [
    (DataError("invalid JSON", origin="a.jsonl:3"), 1),
    (CacheCorruptError("shard-000001.arrow: sha256 mismatch"), 1),
    (DraftTargetMismatchError("draft d: target hidden_size is 64 but the draft was saved with 128"), 1),
    (DraftCheckpointError("d/config.json: not valid JSON"), 1),
    (CheckpointError("step_4/training_state/meta.json: expected a JSON object"), 1),
    (ConfigError("unknown config key 'train.lrr'\n(known under train.: ...)"), 2),
])
def test_every_known_error_is_one_line(error, code, capsys, monkeypatch):
    assert isinstance(error, DeepSpecError)

    def stage(cfg):
        raise error
    monkeypatch.setattr(cli, "_resolve", lambda spec: stage)
    got, err = _run(capsys, "plan")
    assert got == code
    assert _one_line(err) == f"deepspec plan: {cli.error_kind(error)}: {' '.join(str(error).split(chr(10)))}"
    got, err = _run(capsys, "plan", "--debug")
    assert got == code and "Traceback" in err


def test_bugs_keep_their_traceback(capsys, monkeypatch):
    def stage(cfg):
        raise ZeroDivisionError("a bug")
    monkeypatch.setattr(cli, "_resolve", lambda spec: stage)
    with pytest.raises(ZeroDivisionError):
        cli.main(["plan"])
