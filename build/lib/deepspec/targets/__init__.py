"""Targets: one generic adapter over any HF decoder, chat templates, reference and tiny targets."""
from .adapter import INDEX_CONVENTION, Capture, DecodeOutput, TargetAdapter, default_layer_ids
from .chat import ChatEncoding, ChatTemplateError, encode_chat, encode_prompt, render
from .loader import load_target

__all__ = ["INDEX_CONVENTION", "Capture", "DecodeOutput", "TargetAdapter", "default_layer_ids",
           "ChatEncoding", "ChatTemplateError", "encode_chat", "encode_prompt", "render", "load_target"]
