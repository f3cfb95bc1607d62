"""Tokenmill's load generator and benchmarks. Talks to a cluster only through its public APIs."""
