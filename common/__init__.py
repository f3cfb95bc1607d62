"""Tokenmill's shared library: model runtime, paged KV cache, scheduler, sampling, hashing.

Nothing here imports ``services``: services wrap this library, never the reverse. Importing it changes no process's
environment: entry points do that (``common.machine.use_huge_pages``).
"""
