"""Tooling for tests and benchmarks, outside the product: synthetic GGUF models whose
acceptance is known by construction (``testmodels``, ``meshd make-test-model``) and
loopback RPC workers (``loopback``). Product modules never import it
(``tests/unit/test_house.py`` checks)."""
