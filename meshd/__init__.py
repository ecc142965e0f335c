"""meshd: a local LLM daemon that makes speculative decoding pay on one machine.

The code lives in ``meshd.protocol``, ``meshd.plugins``, ``meshd.daemon`` and
``meshd.native``; this package only makes ``python -m meshd`` run the ``meshd`` command.
"""
