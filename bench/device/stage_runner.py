"""One stage of the device run: a subprocess with its own time limit inside the run's overall budget.

A stage past its limit gets SIGTERM (a training run saves a checkpoint on it), then SIGKILL to its whole
process group 20 s later; SIGTERM to this process ends the running stage and keeps what was recorded.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]


class Runner:
    def __init__(self, work: Path, budget_s: float, record: Dict[str, Any], save, extra_env=None):
        self.work, self.budget, self.record, self.save = work, budget_s, record, save
        self.extra_env = dict(extra_env or {})
        self.current: Optional[subprocess.Popen] = None
        self.t0 = time.monotonic()
        (work / "logs").mkdir(parents=True, exist_ok=True)
        signal.signal(signal.SIGTERM, self._stopped)   # e.g. run.sh's overall `timeout`

    def _stopped(self, signum, frame):
        """Stopped from outside: end the running stage (its whole group) and keep what was recorded."""
        if self.current is not None:
            _kill_group(self.current)
        self.record.setdefault("stages", {})["_stopped"] = {"status": "stopped",
                                                           "after_s": round(time.monotonic() - self.t0, 1)}
        self.save()
        raise SystemExit(124)

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def run(self, name: str, cmd: List[str], limit: float, need: float = 0.0) -> Dict[str, Any]:
        """Run ``cmd`` with ``min(limit, time left)`` seconds; its stdout+stderr go to logs/<name>.log."""
        st: Dict[str, Any] = {"command": " ".join(cmd[1:]) if cmd[0] == sys.executable else " ".join(cmd)}
        allowed = min(limit, self.left())
        if allowed < max(need, 5.0):
            st.update(status="skipped", reason=f"{self.left():.0f} s left of the budget")
            self.record["stages"][name] = st
            self.save()
            print(f"[device] {name}: skipped ({st['reason']})", flush=True)
            return st
        log = self.work / "logs" / f"{name}.log"
        print(f"[device] {name}: up to {allowed:.0f} s …", flush=True)
        t = time.monotonic()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **self.extra_env}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
        with open(log, "w") as f:
            p = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            self.current = p
            try:
                rc = p.wait(timeout=allowed)
                status = "ok" if rc == 0 else "failed"
            except subprocess.TimeoutExpired:
                # SIGTERM to the stage's own process only: training saves a checkpoint and shuts its DataLoader
                # workers down itself (a signal to the whole group would kill the workers under it first)
                os.kill(p.pid, signal.SIGTERM)
                try:
                    rc = p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    rc = None
                _kill_group(p)
                rc = p.wait() if rc is None else rc
                status = "timeout"
            finally:
                self.current = None
        st.update(status=status, returncode=rc, seconds=round(time.monotonic() - t, 2), limit_s=round(allowed, 1))
        if status != "ok":
            st["log_tail"] = log.read_text(errors="replace")[-1500:]
        self.record["stages"][name] = st
        self.save()
        print(f"[device] {name}: {status} in {st['seconds']:.1f} s", flush=True)
        return st


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
