"""``meshd soak``: tooling that runs the daemon under load and bad input, kept out of the
daemon's own modules.

One job per module: :mod:`.run` (the command: starts ``meshd serve`` as a child process,
records references, runs the load, stops the daemon), :mod:`.load` (the clients' mixed
load and bad input), :mod:`.probe` (protocol checks on every frame) and :mod:`.report`
(violations, wrong outputs, leaks, RSS and descriptor slopes).
"""
