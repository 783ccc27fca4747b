"""A lossy codec's reconstruction error: measured through the real encode → decode path, and reported.

`reconstruction_error` gives the per-layer relative MSE and mean token cosine (the build keeps it
in the manifest as ``codec_error``); `format_error_report` prints it for ``deepspec cache info``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional

import torch

from .codecs import Codec


def reconstruction_error(codec: Codec, feats: torch.Tensor, last: Optional[torch.Tensor],
                         hidden_size: int, layer_ids: Optional[List[int]] = None,
                         chunk: int = 1024) -> Dict[str, Any]:
    """Per-layer relative MSE and mean token cosine of encode → decode on ``feats`` [N, L*H]."""
    L = feats.shape[1] // hidden_size
    se = torch.zeros(L, dtype=torch.float64)
    energy = torch.zeros(L, dtype=torch.float64)
    cos_sum = torch.zeros(L, dtype=torch.float64)
    lh = {"se": 0.0, "energy": 0.0, "cos": 0.0}
    n = feats.shape[0]
    for a in range(0, n, chunk):
        x = feats[a:a + chunk]
        y = codec.decode(codec.encode(x, "features"), tuple(x.shape), "features").float()
        xr = x.float().reshape(-1, L, hidden_size)
        yr = y.reshape(-1, L, hidden_size)
        se += ((xr - yr).double() ** 2).sum((0, 2))
        energy += (xr.double() ** 2).sum((0, 2))
        cos_sum += torch.nn.functional.cosine_similarity(xr, yr, dim=-1, eps=1e-12).double().sum(0)
        if last is not None:
            xl = last[a:a + chunk]
            yl = codec.decode(codec.encode(xl, "last_hidden"), tuple(xl.shape), "last_hidden").float()
            xl = xl.float()
            lh["se"] += float(((xl - yl).double() ** 2).sum())
            lh["energy"] += float((xl.double() ** 2).sum())
            lh["cos"] += float(torch.nn.functional.cosine_similarity(xl, yl, dim=-1, eps=1e-12).double().sum())
    ids = list(layer_ids) if layer_ids else list(range(L))
    layers = [{"layer_id": int(ids[l]), "rel_mse": float(se[l] / energy[l].clamp_min(1e-30)),
               "cosine": float(cos_sum[l] / max(n, 1))} for l in range(L)]
    out: Dict[str, Any] = {"measured_on": "calibration sample (bf16 capture → encode → decode)",
                           "tokens": int(n), "features": layers}
    tails = getattr(codec, "tail_energy", None)
    if tails:
        for l, t in enumerate(tails):
            layers[l]["svd_tail_energy"] = float(t)
    if last is not None:
        out["last_hidden"] = {"rel_mse": lh["se"] / max(lh["energy"], 1e-30), "cosine": lh["cos"] / max(n, 1)}
    return out


def format_error_report(m: Mapping[str, Any]) -> List[str]:
    """Lines for ``deepspec cache info``."""
    err = m.get("codec_error")
    if not isinstance(err, dict) or not isinstance(err.get("features"), list):
        return []
    lines = [f"reconstruction   measured at build time on {err.get('tokens')} calibration tokens"]
    for e in err["features"]:
        if not isinstance(e, dict):
            continue
        tail = f"  (SVD tail energy {e['svd_tail_energy']:.3e})" if "svd_tail_energy" in e else ""
        lines.append(f"  layer {e.get('layer_id')!s:>4}   rel. MSE {float(e.get('rel_mse', float('nan'))):.3e}   "
                     f"cosine {float(e.get('cosine', float('nan'))):.5f}{tail}")
    lh = err.get("last_hidden")
    if isinstance(lh, dict):
        lines.append(f"  last_hidden  rel. MSE {float(lh.get('rel_mse', float('nan'))):.3e}   "
                     f"cosine {float(lh.get('cosine', float('nan'))):.5f}")
    return lines
