"""The prepared device run (bench/device/run.sh) at its tiny CPU scale: every stage runs, the record,
the summary and the log archive are written where $OUT says, and nothing big is archived."""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_device_run_tiny_on_cpu(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, "TINY": "1", "OUT": str(out), "DEVICE_WORK": str(work), "PYTHON": sys.executable,
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("DEVICE_PROMPTS", None)
    env.pop("EVAL_DATA", None)
    p = subprocess.run(["bash", str(REPO / "bench" / "device" / "run.sh")], env=env, capture_output=True, text=True,
                       timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(x.name for x in out.iterdir()) == ["device_run.json", "device_run.logs.tar.gz", "device_run.md"]
    rec = json.loads((out / "device_run.json").read_text())
    assert rec["tiny"] and rec["env"]["torch"]
    stages = rec["stages"]
    assert [k for k, s in stages.items() if s["status"] != "ok"] == []
    assert set(stages) >= {"env", "regen", "regen_ab", "cache", "train_dspark", "train_dflash", "train_eagle3",
                           "eval_dspark", "eval_dflash", "eval_eagle3", "profile"}
    assert rec["regen"]["tokens_per_s"] > 0 and rec["regen"]["new_tokens"] > 0
    ab = rec["regen_ab"]
    assert set(ab["loops"]) == {"generate", "auto"} and ab["identical"] == ab["prompts"]
    assert rec["cache"]["tokens"] > 0
    for name in ("dspark", "dflash", "eagle3"):
        assert rec["train"][name]["steps"] == 3 and rec["train"][name]["tokens_per_s"] > 0
        ev = rec["eval"][name]
        assert ev["verify_ms"] > 0 and ev["plain_decode_ms_per_token"] > 0
        assert ev["greedy_matched"] == ev["greedy_compared"] > 0
    md = (out / "device_run.md").read_text()
    for section in ("## Stages", "## Regeneration", "## Training", "## Eval", "verify ÷ plain"):
        assert section in md
    with tarfile.open(out / "device_run.logs.tar.gz") as tar:
        names = tar.getnames()
    assert "logs/regen.log" in names and "eval/dspark/report.md" in names and "logs/profile_eval.txt" in names
    assert not any(n.startswith(("cache/shard", "regen/regen.jsonl")) and not n.endswith("job.json") for n in names)
    assert (out / "device_run.logs.tar.gz").stat().st_size < 1_000_000
