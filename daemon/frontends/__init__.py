"""Bytes in, requests and events out: the NDJSON connection and HTTP; neither imports the other."""
