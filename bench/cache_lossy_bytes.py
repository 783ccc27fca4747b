"""Bytes/token and held-out reconstruction error of every lossy codec variant, re-encoding the
samples of an existing bf16 cache (no target forward).  Calibration = first 2048 tokens;
errors measured on the remaining tokens (out of sample).  Writes bench/results/cache_lossy_bytes.json.

    python bench/cache_lossy_bytes.py CACHE_DIR [--out OUT.json]
"""
import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.records import record_path  # noqa: E402
from deepspec.cache import CacheReader, get_codec  # noqa: E402
from deepspec.cache.codecs import encode_array  # noqa: E402
from deepspec.cache.reconstruction import reconstruction_error  # noqa: E402

SPECS = ["bf16", "fp8", "lowrank:64", "lowrank:32", "lowrank:64:fp8", "lowrank:128", "fp8:lhfp8",
         "lowrank:64:fp8:lhfp8"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cache", help="a bf16 cache directory (e.g. bench/work/cache_gate/gate/bf16/cache)")
    ap.add_argument("--out", default=str(record_path("cache_lossy_bytes")), help="record path")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    r = CacheReader(args.cache)
    m = r.manifest
    H, L = m["hidden_size"], len(m["layer_ids"])
    S = [r[i] for i in range(len(r))]
    feats = torch.cat([s["features"] for s in S])
    last = torch.cat([s["last_hidden"] for s in S])
    calib_f, calib_l = feats[:2048], last[:2048]
    T = feats.shape[0]
    out = {"tokens": int(T), "raw": 6 + 2 * H * (L + 1),
           "stored_bf16_cache_bytes_per_token": r.stats()["bytes_per_token"]}
    ids = sum(len(encode_array(s["input_ids"].numpy().astype("<i4")))
              + len(encode_array(s["loss_mask"].numpy().astype("u1"))) for s in S)
    for spec in SPECS:
        p = spec.split(":")
        name, kw = p[0], {}
        if name == "lowrank":
            kw["rank"] = int(p[1])
            if "fp8" in p[2:]:
                kw["coef"] = "fp8"
        if "lhfp8" in p:
            kw["last_hidden"] = "fp8"
        c = get_codec(name, **kw)
        if c.needs_calibration:
            c.calibrate([{"features": calib_f, "last_hidden": calib_l}], hidden_size=H)
        fb = sum(len(c.encode(s["features"], "features")) for s in S)
        lb = sum(len(c.encode(s["last_hidden"], "last_hidden")) for s in S)
        total = (fb + lb + ids) / T
        row = {"features_B_tok": fb / T, "last_hidden_B_tok": lb / T, "ids_mask_B_tok": ids / T,
               "total_B_tok": total, "fraction_of_raw": total / out["raw"]}
        if c.needs_calibration:
            err = reconstruction_error(c, feats[2048:], last[2048:], H, m["layer_ids"])
            row["heldout_rel_mse"] = [round(e["rel_mse"], 5) for e in err["features"]]
            row["heldout_cos"] = [round(e["cosine"], 5) for e in err["features"]]
            row["heldout_last_hidden_rel_mse"] = err["last_hidden"]["rel_mse"]
        out[spec] = row
        print(spec, json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
