"""Tokenizer-side helpers: turning generated token ids back into streamed text."""
