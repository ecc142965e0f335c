"""The ``llama-server`` that llama.cpp's server test suite starts, for one arm of
``meshd bench-peer-suite``: it replaces itself (exec) with ``meshd serve`` or the real
llama-server, on the fixed model file, in an environment without ``OMP_*``/``GOMP_*``/
``MESHD_*`` variables, so the suite's SIGTERM reaches the server itself."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .llama_server_flags import llama_server_argv, meshd_serve_argv
from .processes import clean_env


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m meshd.bench.peer_launcher")
    p.add_argument("--arm", choices=("meshd", "llama-server"), required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--meshd", default="meshd")
    p.add_argument("--llama-server")
    p.add_argument("--socket-dir", type=Path, default=Path("/tmp"))
    p.add_argument("server_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    server_args = [a for a in args.server_args if a != "--"] if args.server_args[:1] == ["--"] \
        else list(args.server_args)
    if args.arm == "llama-server":
        if not args.llama_server:
            p.error("--llama-server is required for the llama-server arm")
        command = llama_server_argv(args.llama_server, server_args, args.model)
    else:
        serve = meshd_serve_argv(args.meshd, server_args, args.model,
                                 args.socket_dir / f"meshd-{os.getpid()}.sock")
        if serve.ignored:
            print(f"peer launcher: meshd has no counterpart for {' '.join(serve.ignored)}",
                  file=sys.stderr, flush=True)
        command = list(serve.argv)
    print(f"peer launcher: {' '.join(command)}", file=sys.stderr, flush=True)
    os.execvpe(command[0], command, clean_env())
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
