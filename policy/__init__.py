"""meshd.policy: speculation's decisions and economics, pure (no llama.cpp, threads, clocks)."""
