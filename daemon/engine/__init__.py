"""The synchronous verify-commit-repair step: one request's generation, forwards shared by
requests, windows, prefill, sampling, stopping, constraints.
"""
