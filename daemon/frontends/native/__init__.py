"""meshd's own NDJSON protocol over the socket."""
