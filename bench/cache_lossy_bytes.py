"""Bytes/token and held-out reconstruction error of every lossy codec variant, re-encoding the
samples of an existing bf16 cache (no target forward).  Calibration = first 2048 tokens;
errors measured on the remaining tokens (out of sample).

    python bench/cache_lossy_bytes.py CACHE_DIR OUT.json
"""
import torch, json, sys
torch.set_num_threads(1)
from deepspec.cache import CacheReader, get_codec
from deepspec.cache.codecs import encode_array
from deepspec.cache.codec_error import reconstruction_error
r = CacheReader(sys.argv[1]); m = r.manifest
H, L = m["hidden_size"], len(m["layer_ids"])
S = [r[i] for i in range(len(r))]
feats = torch.cat([s["features"] for s in S]); last = torch.cat([s["last_hidden"] for s in S])
calib_f, calib_l = feats[:2048], last[:2048]
out = {"tokens": int(feats.shape[0]), "raw": 6 + 2*H*(L+1), "stored_bf16_cache_bytes_per_token": r.stats()["bytes_per_token"]}
ids = sum(len(encode_array(s["input_ids"].numpy().astype("<i4"))) + len(encode_array(s["loss_mask"].numpy().astype("u1"))) for s in S)
for spec in ["bf16", "fp8", "lowrank:64", "lowrank:32", "lowrank:64:fp8", "lowrank:128", "fp8:lhfp8", "lowrank:64:fp8:lhfp8"]:
    p = spec.split(":"); name = p[0]; kw = {}
    if name == "lowrank": kw["rank"] = int(p[1])
    if "fp8" in p[2:] and name == "lowrank": kw["coef"] = "fp8"
    if "lhfp8" in p: kw["last_hidden"] = "fp8"
    c = get_codec(name, **kw)
    if c.needs_calibration: c.calibrate([{"features": calib_f, "last_hidden": calib_l}], hidden_size=H)
    fb = sum(len(c.encode(s["features"], "features")) for s in S)
    lb = sum(len(c.encode(s["last_hidden"], "last_hidden")) for s in S)
    T = feats.shape[0]
    err = reconstruction_error(c, feats[2048:], last[2048:], H, m["layer_ids"]) if c.needs_calibration else None
    row = {"features_B_tok": fb/T, "last_hidden_B_tok": lb/T, "ids_mask_B_tok": ids/T, "total_B_tok": (fb+lb+ids)/T, "fraction_of_raw": (fb+lb+ids)/T/out["raw"]}
    if err: row["heldout_rel_mse"] = [round(e["rel_mse"],5) for e in err["features"]]; row["heldout_cos"] = [round(e["cosine"],5) for e in err["features"]]; row["heldout_last_hidden_rel_mse"] = err["last_hidden"]["rel_mse"]
    out[spec] = row; print(spec, json.dumps(row), flush=True)
json.dump(out, open(sys.argv[2], "w"), indent=1)
