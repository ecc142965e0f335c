"""meshd.policy: speculation's decisions and economics, no I/O (no llama.cpp, threads, clocks)."""
