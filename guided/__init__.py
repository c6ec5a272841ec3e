"""Guided decoding, request side: structured output (a JSON schema, a regex, a choice list -> a grammar, compiled
against the tokenizer; ``grammars.py``) and tool calling (``tools.py``). Errors are ``errors.GuidedError``, which
``api/`` answers as a 400. No torch, no fastapi."""
