"""The draft vocabulary at the start of training (`draft.vocab_size = N`, see docs/CONTRACTS.md)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import numpy as np

from deepspec.data.vocab import count_answer_tokens, coverage, save_vocab, select_top

log = logging.getLogger("deepspec.train")


def install_draft_vocab(d, source, train_idx, target, init_from: Optional[str], run_dir: Optional[Path]) -> None:
    """Install the draft vocabulary of drafter ``d``: the N most frequent answer tokens of the training
    split (plus the target's EOS tokens), the same on every rank; written to ``run_dir``/draft_vocab.json
    (``run_dir`` None: another rank writes it).  With
    draft.init_from (a draft of the same vocabulary size, `init_weights_from` checks) its vocabulary
    is kept — its weights were trained on it — and a difference from this split's selection is logged."""
    tokens = getattr(source, "tokens", source.__getitem__)
    counts = count_answer_tokens((tokens(i) for i in train_idx), d.vocab_size)
    selected = select_top(counts, d.out_vocab, always=target.eos_token_ids)
    origin = f"top-{d.out_vocab} answer tokens of {len(train_idx)} training sequences"
    if init_from:
        ids = d.draft_vocab.cpu().numpy()
        origin = f"kept from draft.init_from={init_from}"
        cov, cov_sel = coverage(counts, ids), coverage(counts, selected)
        differ = int(np.setdiff1d(selected, ids).size)
        if differ:
            log.warning("draft vocabulary kept from draft.init_from=%s: %d of its %d tokens differ from the "
                        "top-%d of this training split (coverage %.2f%% kept vs %.2f%% re-selected); the "
                        "init_from weights were trained on their own vocabulary, so it is kept",
                        init_from, differ, d.out_vocab, d.out_vocab, 100 * cov, 100 * cov_sel)
        else:
            log.info("draft vocabulary kept from draft.init_from=%s (the same as this training split selects)",
                     init_from)
    else:
        ids = selected
        d.set_draft_vocab(ids)
        cov = coverage(counts, ids)
    missing_eos = sorted(set(int(t) for t in target.eos_token_ids) - set(int(t) for t in ids))
    if missing_eos:
        log.warning("draft vocabulary lacks the target's end-of-turn/EOS token(s) %s: the draft can never "
                    "propose the end of an answer", missing_eos)
    log.info("draft vocabulary: %d of %d target tokens cover %.2f%% of the training answer tokens",
             d.out_vocab, d.vocab_size, 100 * cov)
    if run_dir is not None:
        save_vocab(Path(run_dir) / "draft_vocab.json", ids, vocab_size=d.vocab_size,
                   tokenizer_fingerprint=target.fingerprint()["tokenizer_sha256"], coverage_value=cov,
                   source=origin)
