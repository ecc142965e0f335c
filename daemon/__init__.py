"""meshd.daemon: the product, which turns requests into committed tokens."""
