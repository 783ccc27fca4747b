"""API keys of OpenAI-compatible servers never reach logs, resolved configs, outputs or error files.

`deepspec prepare` (the real stage entry point) regenerates through a real `deepspec serve`
that requires the key, read from ``engine.api_key_file`` (and, in the second run, from
``engine.api_key_env``).  One sample fails on the server so the error file is written; logging
is captured at DEBUG for every logger (urllib3 included).  The key must appear in none of:
captured logs, stdout/stderr, resolved_config.yaml, regen.jsonl (+ meta), regen.errors.jsonl,
the job file, the part files.  A wrong key is rejected without echoing either key.
(tests/unit/test_engines_openai.py covers reading the key and the client's repr/describe.)
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from deepspec.config import load_config, to_yaml
from deepspec.engines.base import EngineError
from deepspec.engines.handler import Faults
from deepspec.engines.server import serve_in_thread

torch.set_num_threads(1)
KEY = "sk-test-DO-NOT-LEAK-5f2c9a"


def _files(root: Path):
    return [p for p in root.rglob("*") if p.is_file()]


def _assert_clean(texts, what):
    for name, text in texts:
        assert KEY not in text, f"API key leaked into {what}: {name}"
        assert KEY[:12] not in text, f"part of the API key leaked into {what}: {name}"


def test_api_key_never_written_or_logged(tmp_path, monkeypatch, caplog, capsys):
    from deepspec.engines.hf import HFEngine
    from deepspec.prepare import run as prepare
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "turns": [f"question {i}"]}) + "\n" for i in range(5)))
    key_file = tmp_path / "key.txt"
    key_file.write_text(KEY + "\n")
    engine = HFEngine.from_config(load_config(["target.path=tiny:llama", "target.dtype=float32"]), device="cpu")
    faults = Faults(fail_when=lambda b: any(m.get("content") == "question 3" for m in b.get("messages", [])))
    with serve_in_thread(engine, api_key=KEY, faults=faults) as h:
        base = ["data=jsonl", f"data.path={data}", "data.heldout_fraction=0", "data.online=true",
                "engine.kind=openai", f"engine.servers=[{h.url}]", "engine.max_new_tokens=4",
                "engine.max_retries=1", "engine.backoff_s=0.01", "engine.progress=false",
                "engine.api_key_env=DEEPSPEC_TEST_UNSET_KEY_VAR"]
        monkeypatch.delenv("DEEPSPEC_TEST_UNSET_KEY_VAR", raising=False)
        with caplog.at_level(logging.DEBUG):
            # key from a file
            cfg = load_config(base + [f"run_dir={tmp_path / 'a'}", f"engine.api_key_file={key_file}"])
            assert prepare(cfg) == 0
            # key from the environment
            monkeypatch.setenv("DEEPSPEC_TEST_UNSET_KEY_VAR", KEY)
            cfg_env = load_config(base + [f"run_dir={tmp_path / 'b'}"])
            assert prepare(cfg_env) == 0
            # a wrong key: refused, and neither key is repeated back
            monkeypatch.setenv("DEEPSPEC_TEST_UNSET_KEY_VAR", "sk-wrong-key-0000")
            with pytest.raises(EngineError, match="API key rejected") as ei:
                prepare(load_config(base + [f"run_dir={tmp_path / 'c'}"]))
            assert "sk-wrong-key" not in str(ei.value) and KEY not in str(ei.value)
    out = capsys.readouterr()
    for run in ("a", "b"):
        files = _files(tmp_path / run)
        names = {p.name for p in files}
        assert {"resolved_config.yaml", "regen.jsonl", "regen.errors.jsonl"} <= names, names
        errs = [json.loads(x) for p in files if p.name == "regen.errors.jsonl" for x in p.read_text().splitlines()]
        assert [e["id"] for e in errs] == ["q3"]            # the error file was really written
        rows = [json.loads(x) for p in files if p.name == "regen.jsonl" for x in p.read_text().splitlines()]
        assert len(rows) == 4 and all(r["meta"]["engine"] == "openai" for r in rows)
        _assert_clean([(str(p), p.read_text(errors="replace")) for p in files], "run files")
    _assert_clean([("logs", caplog.text), ("stdout", out.out), ("stderr", out.err)], "logs/console")
    assert "API key rejected" in caplog.text           # the rejection itself is logged, without the key
    # the config carries the variable's name / the file's path, never the key; so does what
    # training hands to wandb (the config as a dict)
    from deepspec.train.logging import config_as_dict
    for c in (cfg, cfg_env):
        y = to_yaml(c)
        assert KEY not in y and "DEEPSPEC_TEST_UNSET_KEY_VAR" in y
        assert KEY not in json.dumps(config_as_dict(c), default=str)
    assert str(key_file) in to_yaml(cfg)
