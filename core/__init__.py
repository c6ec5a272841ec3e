"""The domain every runtime shares, torch-free and HTTP-free: one ``Sequence`` per request with its status
(``sequence.py``), the KV block books and the prefix cache (``block_manager.py``), sampling on numpy
(``sampling.py``), and the per-request view a handler awaits (``generation.py``)."""
