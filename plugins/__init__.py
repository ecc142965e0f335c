"""meshd.plugins: the proposer interface and every proposer, built-in or third-party."""
