"""meshd.clients: the command-line clients of a running daemon (``meshctl``, the client
half of ``meshd demo``) and the small command-line helpers they share with ``meshd``.

They speak to the daemon only through its socket (``meshd.protocol``), so importing them
loads no model runtime, no numpy and no llama.cpp.
"""
