"""Ship (or replace) a trained draft inside the package: one reproducible command.

    python tools/ship_draft.py --run-dir RUN_DIR [--checkpoint step_N] --name NAME \\
        --command "<the training command>" --data-note "..." --preparation "cmd1" "cmd2" \\
        [--eval-check EVAL_DIR/results.json]

Loads the run's checkpoint (the newest complete one by default) with the project's loaders against the
run's target (``RUN_DIR/run.yaml``, loaded on the CPU), casts the trained weights to bfloat16 and
writes ``config.json`` + ``model.safetensors`` (`save_pretrained`), ``provenance.json`` and a
``README.md`` model card (and, with ``--calibration``, the draft's ``calibration.json``) into a temporary directory beside ``deepspec/shipped/NAME``; the result is
loaded back and compared with the cast weights, then it replaces ``NAME`` (`deepspec.utils.fs.atomic_dir`).
Refuses, changing nothing, when RUN_DIR has no complete checkpoint, when NAME is not a plain directory
name, when an ``--eval-check`` did not decode this draft, or when everything under the shipped root
would exceed the budget (25 MB, what `tests/slow/test_shipped_draft.py` allows).
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from deepspec.errors import DeepSpecError  # noqa: E402
from deepspec.paths import SHIPPED_DIR, SHIPPED_FOR_TARGET  # noqa: E402
from deepspec.schedule.calibration import CALIBRATION_FILENAME  # noqa: E402
from deepspec.train.checkpoint import (is_complete, latest_checkpoint, list_checkpoints,  # noqa: E402
                                       run_config_path)
from deepspec.export.card import shipped_card  # noqa: E402
from tools.ship_record import (ShipError, calibration_record, data_stats, display, eval_check,  # noqa: E402
                               heldout_rows, heldout_split, provenance, trained_on)

BUDGET_MB = 25.0
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_name(name: str) -> str:
    if not NAME_RE.fullmatch(name or "") or name.endswith(".tmp"):
        raise ShipError(f"--name {name!r}: not a plain directory name (letters, digits, '.', '_', '-'; no path)")
    return name


def find_checkpoint(run_dir: Path, step: Optional[str]) -> Path:
    """``RUN_DIR/checkpoints/<step>`` when complete, else the newest complete checkpoint."""
    root = Path(run_dir) / "checkpoints"
    if step is None:
        ck = latest_checkpoint(root)
        if ck is None:
            raise ShipError(f"{root}: no complete checkpoint (step_N/ with training_state/meta.json)")
        return ck
    ck = root / step
    if not is_complete(ck):
        have = ", ".join(p.name for _, p in list_checkpoints(root)) or "none"
        raise ShipError(f"{ck}: not a complete checkpoint (complete ones: {have})")
    return ck


def tree_bytes(root: Path, skip: Sequence[Path] = ()) -> int:
    """Bytes of every file under ``root``, except under the directories in ``skip``."""
    skip = [Path(s).resolve() for s in skip]
    total = 0
    for f in Path(root).rglob("*"):
        if f.is_file() and not any(s == f.resolve() or s in f.resolve().parents for s in skip):
            total += f.stat().st_size
    return total


def readable(d: Path) -> None:
    """Package data modes (the temp directory is created 0700, safetensors writes 0600)."""
    d.chmod(0o755)
    for f in d.iterdir():
        f.chmod(0o644)


def bf16(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Floating tensors cast to bfloat16; integer ones (``draft_vocab``) unchanged."""
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}


def same_values(drafter, state: Dict[str, torch.Tensor]) -> List[str]:
    """Names whose value in ``drafter`` (any float dtype) differs from ``state``'s or is missing."""
    own = drafter.state_dict()
    bad = sorted(set(own) ^ set(state))
    return bad + [k for k in state if k in own and not torch.equal(own[k].to(state[k].dtype).cpu(), state[k])]


def cast_drafter(ck: Path, target):
    """The checkpoint's drafter with its trained weights cast to bfloat16: (drafter, raw weights, cast weights)."""
    from deepspec.drafts import load_drafter
    from deepspec.drafts.checkpoint import load_weights

    drafter = load_drafter(ck, target)                       # fingerprint, shapes and draft vocabulary checked
    raw = load_weights(ck, "cpu")
    weights = bf16(raw)
    drafter.to(torch.bfloat16).load_state_dict(weights, strict=True)
    return drafter, raw, weights


def read_calibration(arg: Optional[str], gamma: int):
    """(calibration file, its record) for ``--calibration`` (a file or a directory holding one); Nones without."""
    cal_file = Path(arg) if arg else None
    if cal_file is not None and cal_file.is_dir():
        cal_file = cal_file / CALIBRATION_FILENAME
    calib = calibration_record(cal_file, gamma) if cal_file is not None else None
    return cal_file, calib


def heldout_rows_or_warn(run_dir: Path, meta: Dict) -> List:
    """The run's held-out eval rows up to the checkpoint's step; warns when there are none."""
    rows = heldout_rows(run_dir, int(meta["step"]))
    if not rows:
        print(f"ship_draft: warning: {run_dir / 'metrics.jsonl'} has no held-out eval rows up to step "
              f"{meta['step']}; the card says so", file=sys.stderr)
    return rows


def load_hint(target_name: str, name: str, out: Path, default_root: bool) -> str:
    """How the model card tells a reader to load the shipped draft."""
    if default_root and SHIPPED_FOR_TARGET.get(target_name) == name:
        return (f'`deepspec.drafts.load_drafter(deepspec.paths.shipped_draft_dir("{target_name}"), target)`; '
                "`deepspec demo` evaluates it beside the draft it trains")
    if default_root:
        return f'`deepspec.drafts.load_drafter(deepspec.paths.SHIPPED_DIR / "{name}", target)`'
    return f'`deepspec.drafts.load_drafter("{display(out)}", target)`'


def remove_stale(root: Path, name: str) -> None:
    """Temp directories of ``name`` left under ``root`` by a ship that was killed mid-way."""
    for stale in root.glob(f".{name}.ship-*"):
        print(f"ship_draft: removing {stale}, left by an interrupted ship", file=sys.stderr)
        shutil.rmtree(stale)


def write_extras(tmp: Path, prov: Dict, cfg, cal_file: Optional[Path], calib, scored, hint: str,
                 notes: Sequence[str]) -> None:
    """Beside the saved weights: the calibration (when given), ``provenance.json`` and the ``README.md`` card."""
    if calib is not None:   # policies read {checkpoint}/calibration.json by default
        shutil.copyfile(cal_file, tmp / CALIBRATION_FILENAME)
    (tmp / "provenance.json").write_text(json.dumps(prov, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    card = shipped_card(prov, train_cfg=cfg.train, weights_bytes=(tmp / "model.safetensors").stat().st_size,
                        heldout_sequences=scored, load_hint=hint, notes=notes)
    (tmp / "README.md").write_text(card, encoding="utf-8")


def verify_shipment(tmp: Path, target, weights: Dict[str, torch.Tensor], root: Path, out: Path, name: str,
                    budget_mb: float):
    """Make ``tmp`` package-readable, reload it against the cast weights and check the size budget:
    (bytes of the new draft, bytes of everything else under ``root``)."""
    from deepspec.drafts import load_drafter

    readable(tmp)
    bad = same_values(load_drafter(tmp, target), weights)
    if bad:
        raise ShipError(f"{tmp / 'model.safetensors'}: reloaded weights differ from the bf16 cast: {bad[:5]}")
    new, others = tree_bytes(tmp), tree_bytes(root, skip=(tmp, out))
    budget = budget_mb * 2 ** 20
    if new + others > budget:
        raise ShipError(f"{out / 'model.safetensors'}: shipping {name} ({new / 2 ** 20:.2f} MB) would bring "
                        f"{display(root)} to {(new + others) / 2 ** 20:.2f} MB, over its {budget_mb:g} MB "
                        f"budget ({others / 2 ** 20:.2f} MB are other shipped drafts); nothing was changed")
    return new, others


def ship(args: argparse.Namespace, argv: Sequence[str]) -> Path:
    from deepspec.config import config_from_yaml
    from deepspec.targets import load_target
    from deepspec.utils.fs import atomic_dir

    name = check_name(args.name)
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ShipError(f"{run_dir}: no such run directory")
    ck = find_checkpoint(run_dir, args.checkpoint)
    meta = json.loads((ck / "training_state" / "meta.json").read_text(encoding="utf-8"))
    cfg = config_from_yaml(run_config_path(run_dir, ck))
    root = Path(args.shipped_root)
    out = root / name

    target = load_target(cfg.target, device="cpu")
    drafter, raw, weights = cast_drafter(ck, target)
    check = None
    if args.eval_check:
        check = eval_check(Path(args.eval_check), ck, raw, weights, target.fingerprint())
    cal_file, calib = read_calibration(args.calibration, int(cfg.draft.gamma))

    data = data_stats(cfg, run_dir, target)
    split, scored = heldout_split(cfg, data, meta)
    rows = heldout_rows_or_warn(run_dir, meta)
    default_root = root.resolve() == SHIPPED_DIR.resolve()
    hint = load_hint(cfg.target.name, name, out, default_root)

    root.mkdir(parents=True, exist_ok=True)
    remove_stale(root, name)
    with atomic_dir(out, prefix=f".{name}.ship-") as tmp:
        drafter.save_pretrained(tmp)
        saved = json.loads((tmp / "config.json").read_text(encoding="utf-8"))
        prov = provenance(name=name, target_note=args.target_note or f"{cfg.target.name} ({cfg.target.path})",
                          command=args.command, ship_command=shlex.join(["python", "tools/ship_draft.py", *argv]),
                          run_dir=run_dir, checkpoint=ck, meta=meta, draft_config=saved["draft"], data=data,
                          data_note=args.data_note, preparation=args.preparation, heldout=rows, split=split,
                          trained=trained_on(run_dir, meta), check=check, calibration=calib)
        write_extras(tmp, prov, cfg, cal_file, calib, scored, hint, args.card_note)
        new, others = verify_shipment(tmp, target, weights, root, out, name, args.budget_mb)
    if default_root and SHIPPED_FOR_TARGET.get(cfg.target.name) != name:
        print(f"ship_draft: note: deepspec/paths.py SHIPPED_FOR_TARGET maps target {cfg.target.name!r} to "
              f"{SHIPPED_FOR_TARGET.get(cfg.target.name)!r}: `deepspec demo` uses {name} only once it maps there",
              file=sys.stderr)
    print(f"shipped {display(ck)} as {display(out)} ({new / 2 ** 20:.2f} MB; {display(root)} now holds "
          f"{(new + others) / 2 ** 20:.2f} of {args.budget_mb:g} MB)")
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True,
                   help="the training run directory (run.yaml, checkpoints/, metrics.jsonl)")
    p.add_argument("--checkpoint", help="step_N under RUN_DIR/checkpoints (default: the newest complete one)")
    p.add_argument("--name", required=True, help="directory name under the shipped root, e.g. smollm2-135m-dspark")
    p.add_argument("--command", required=True, help="the command that trained the run (recorded as given)")
    p.add_argument("--data-note", required=True, help="where the conversations came from and how they were regenerated")
    p.add_argument("--preparation", nargs="*", default=[], help="the commands that prepared the data, in order")
    p.add_argument("--eval-check", help="results.json of a greedy `deepspec eval` of this checkpoint (or of the "
                                        "shipped bf16 weights): its τ, prompts and losslessness are recorded")
    p.add_argument("--calibration", help="calibration.json that `deepspec calibrate` fitted on rollouts of this draft "
                                         "(held-out prompts, not the eval benchmarks): shipped beside the weights, "
                                         "where the threshold and scheduler policies find it")
    p.add_argument("--target-note", help="how the target is described (default: its config name and path)")
    p.add_argument("--card-note", action="append", default=[], help="an extra line for the model card (repeatable)")
    p.add_argument("--shipped-root", default=str(SHIPPED_DIR),
                   help="where shipped drafts live (default: the package's deepspec/shipped)")
    p.add_argument("--budget-mb", type=float, default=BUDGET_MB, help="size limit of everything under the shipped root")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    try:
        ship(args, argv)
    except (ShipError, DeepSpecError, FileNotFoundError) as e:   # each names its file; a bug keeps its traceback
        print(f"ship_draft: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
