"""Prompt ingestion: sources → `Conversation`s, the held-out split, error accounting."""
from .conversation import (ROLE_ALIASES, Conversation, DataError, UnknownRoleError, fallback_id,
                           normalise_role, record_to_conversation)
from .ingest import ErrorFile, IngestStats, load_conversations
from .sources import (RawRecord, iter_files, iter_hf, iter_json_array, iter_jsonl, iter_parquet,
                      iter_sharegpt_package, iter_source, sharegpt_package_file)
from .split import heldout_record, is_heldout, split_conversations, split_score, write_heldout, write_jsonl_atomic

__all__ = [
    "ROLE_ALIASES", "Conversation", "DataError", "UnknownRoleError", "fallback_id", "normalise_role",
    "record_to_conversation", "ErrorFile", "IngestStats", "load_conversations", "RawRecord", "iter_files",
    "iter_hf", "iter_json_array", "iter_jsonl", "iter_parquet", "iter_sharegpt_package", "iter_source",
    "sharegpt_package_file", "heldout_record", "is_heldout", "split_conversations", "split_score",
    "write_heldout", "write_jsonl_atomic",
]
