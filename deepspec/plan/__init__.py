"""Measure before committing to a run, above all the stages: `estimate` (``deepspec plan``: tokens,
cache bytes and hours from short measured `probes`) and `gate` (``deepspec gate``: does a lossy
cache codec keep the drafter's acceptance length? build, train and evaluate per codec)."""
