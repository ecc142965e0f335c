"""meshd over HTTP: OpenAI-compatible endpoints, health and Prometheus metrics.

``sniff`` tells an HTTP request from an NDJSON frame on the daemon's Unix socket;
``connection`` drives h11 for one connection; ``routes`` maps paths to endpoints;
``openai_api`` and ``completions`` translate OpenAI's requests and responses
(``request_fields`` decides which fields pass, ``identity`` the ``system_fingerprint``);
``llama_extras`` serves llama-server's extra endpoints; ``sse`` frames streamed chunks;
``tcp`` is the optional loopback listener; ``config`` the limits.
"""
