"""Benchmarks: tooling that measures the daemon, kept out of the daemon's own modules.

One job per module: :mod:`.cli` (``meshd bench``'s options and command), :mod:`.run`
(runs the arms interleaved and builds the report), :mod:`.arms` (models, workloads and
arms), :mod:`.summary` (one arm's medians, ratios and counters), :mod:`.targets`
(PASS/MISS lines), :mod:`.format` (the printed table), :mod:`.plot` (``--plot``),
:mod:`.workloads` (the shipped prompts in ``workloads/`` and users' files),
:mod:`.identity` (``meshd bench --identity``), :mod:`.llama_server` (llama.cpp's server
as extra arms), :mod:`.processes` (the benchmarks' child servers: clean environment,
readiness, CPU time, stopping), :mod:`.e2e` (``meshd bench-e2e``) with
:mod:`.e2e_arms` (its arms and requests), :mod:`.stream_client` (a streaming OpenAI
client's timings) and :mod:`.e2e_report` (its table), :mod:`.rpc` (``meshd
bench-rpc``), :mod:`.threads` (``meshd bench-threads``), :mod:`.socket_cost` (what
the Unix socket costs), and :mod:`.peer_suite` (``meshd bench-peer-suite``: llama.cpp's
server tests against both servers) with :mod:`.peer_launcher`, :mod:`.peer_plugin` and
:mod:`.llama_server_flags`.
"""
