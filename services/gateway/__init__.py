"""The gateway: the public ``Frontend.Generate`` API; tokenize → place → prefill → decode, streamed back."""
