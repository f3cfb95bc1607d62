"""The decode pool: continuous batching over every sequence, KV pulled from prefill workers over NIXL."""
