"""``tokenmill up | serve | status``: run the cluster as local processes, one service, or inspect it."""
