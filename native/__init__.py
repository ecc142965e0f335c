"""meshd.native: everything that touches llama.cpp, nothing about sockets or requests."""
