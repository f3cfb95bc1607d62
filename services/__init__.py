"""Tokenmill's services (one package per pool) and the ``tokenmill`` command line."""
