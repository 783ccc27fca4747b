"""Decoding policies: how a drafter and a target produce tokens, losslessly, one request at a time.

- `warp`: temperature / top-k / top-p / min-p (the one implementation; the engines sample through it too)
- `loop`: what every speculative loop shares (`DecodeLoop`, `RoundStats`, `GenerationResult`) and plain
  decoding (`target_generate`)
- `chain`: chain verification (`speculative_generate`), with `acceptance` (the speculative-sampling rule)
  and `policy` (the verification-length hook the loop calls; the policies are `deepspec.schedule`)
- `tree`: draft trees (`grow_tree` over a drafter's `TreeExpansion`), `tree_mask` (the target's ancestor
  mask and positions), `lookup` (prompt lookup grafted onto trees), `tree_accept` (greedy and
  multi-candidate sampled acceptance), `tree_loop` (`tree_generate`)
- `row_invariant`: verification rows through the one-token attention call (bit-equal rows where the matmuls are
  batch-invariant)
- `settings`: which of them a run uses, from the eval config

The loops never name an algorithm: they drive any drafter through the decoding API of `deepspec.drafts`.
This package imports nothing at import time, so `deepspec.decoding.warp` stays light for the engines.
"""
