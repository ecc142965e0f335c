"""A real, well-behaved plugin process that records what the daemon shows it.

``python probe_plugin.py NAME RECORD [--socket PATH]``: an SDK plugin called NAME that
proposes the last token again (a cheap guess, sometimes right) and appends one JSON line
to the file RECORD for every request it is asked about: its own pid and the request's
``prompt_text`` (null when the daemon withheld it).
"""

from __future__ import annotations

import json
import os
import sys

from meshd.plugins import sdk
from meshd.plugins.resources import Need, requires

NAME, RECORD = sys.argv[1], sys.argv[2]


@requires(Need.PROMPT_TEXT)
def propose(ctx: sdk.Context) -> list[int]:
    if not ctx.state.get("recorded"):
        ctx.state["recorded"] = True
        with open(RECORD, "a", encoding="utf-8") as out:
            out.write(json.dumps({"pid": os.getpid(), "prompt_text": ctx.prompt_text}) + "\n")
    return list(ctx.tokens[-1:])


if __name__ == "__main__":
    raise SystemExit(sdk.Plugin(NAME, propose, version="1").main(sys.argv[3:]))
