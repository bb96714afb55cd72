"""Prompt sources: the built-in tasks' prompts, and a user's Parquet or JSONL prompts (chat or plain)."""
