"""HTTP/1.1 (h11): routes, SSE, access, TCP, resumable streams, metrics."""
