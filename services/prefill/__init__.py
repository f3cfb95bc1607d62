"""The prefill pool: prompts in, first token + a leased KV handle out."""
