"""The tokenizer pool: text or chat messages → token ids (batched), and ids → text."""
