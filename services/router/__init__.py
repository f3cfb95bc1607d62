"""The router: keeps every worker's load and cached blocks from its reports, and places requests."""
