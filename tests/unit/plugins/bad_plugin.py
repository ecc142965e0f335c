"""A real misbehaving proposer plugin process, for the daemon's fault tests.

``python bad_plugin.py MODE`` (spawned by the daemon; the SDK finds its socketpair in
``MESHD_PLUGIN_FD``). Every MODE answers the first ``propose`` of a plugin process
correctly (a valid one-token guess), then misbehaves on every later one:

sleep (answers after the deadline), silent (never answers), oov (ids outside the
vocabulary), huge (10,000 tokens), raise (the propose function raises), exit (the
process exits mid-request), garbage (bytes that are no plugin message), flood (floods
answers to steps nobody asked about).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence

from meshd.plugins import sdk
from meshd.protocol.plugin import Abstain, encode_plugin
from meshd.protocol.plugin_channel import PluginChannel

MODE = sys.argv[1] if len(sys.argv) > 1 else "sleep"


class BadPlugin(sdk.Plugin):
    channel: PluginChannel | None = None
    calls = 0

    def serve(self, channel: PluginChannel) -> int:
        self.channel = channel
        return super().serve(channel)

    def call(self, ctx: sdk.Context) -> tuple[int, ...]:
        """Bypasses the SDK's own trimming: the daemon must cope with anything."""
        self.calls += 1
        if self.calls == 1:
            return (ctx.tokens[-1],)
        if MODE == "sleep":
            time.sleep(max(0.0, ctx.deadline - time.monotonic()) + 0.05)
            return (ctx.tokens[-1],)
        if MODE == "silent":
            time.sleep(3600)
        if MODE == "oov":
            return (ctx.n_vocab + 7,)
        if MODE == "huge":
            return tuple([ctx.tokens[-1]] * 10_000)
        if MODE == "raise":
            raise RuntimeError("the plugin's code is broken")
        if MODE == "exit":
            os._exit(3)
        if MODE == "garbage":
            assert self.channel is not None
            self.channel.send_bytes(b"\x00\xff not json at all {{{\n")
            return ()
        if MODE == "flood":
            assert self.channel is not None
            bogus = Abstain(ctx.request_id, -1)
            self.channel.send_bytes(encode_plugin(bogus) * 1000)
            return (ctx.tokens[-1],)
        raise SystemExit(f"unknown mode {MODE}")


def never(ctx: sdk.Context) -> Sequence[int]:  # replaced by BadPlugin.call
    return ()


if __name__ == "__main__":
    sys.exit(BadPlugin(MODE, never, max_len=16).main([]))
