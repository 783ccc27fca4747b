"""Prepare: regenerate the answers with the target (`regenerate`), then capture its hidden states
into the cache (`build_cache`); `run` is the `deepspec prepare` stage doing both.  See
``docs/prepare.md`` and ``docs/cache.md``; the cache's format and reader are `deepspec.cache`."""
from .regen import regenerate
from .regen_job import RegenError
from .stage import run

__all__ = ["run", "regenerate", "RegenError"]
