"""The HTTP layer: routers that only translate (``generate.py``, ``openai/``, ``tokenize.py``, ``probes.py``,
``admin.py``), the path from a validated request to a running generation (``serving.py``) and back to an answer
(``streaming.py``), the error shape and the translation of domain errors into it (``errors.py``), and what guards
the door (``ops.py``, ``transport.py``, ``metrics.py``). The only package that imports fastapi. No torch."""
