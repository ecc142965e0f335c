"""Ollama's API (``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/ps``,
``/api/show``, ``/api/version``) on the same socket and listeners as OpenAI's: each
request mapped onto the OpenAI pipeline (:mod:`.wire`), answered in Ollama's shapes
(:mod:`.answers`); the model store's endpoints refused (:mod:`.routes`)."""
