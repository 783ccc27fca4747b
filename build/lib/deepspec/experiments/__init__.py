"""Experiments that combine the stages, above all of them: `plan` (``deepspec plan``: tokens, cache
bytes and hours from short measured `probes`) and `gate` (``deepspec cache gate``: does a lossy
cache codec keep the drafter's acceptance length? build, train and evaluate per codec).  The
benchmarks under ``bench/`` use them as well."""
