"""GGUF, torch-free: the file reader (``reader.py``), every served type's block layout with its reference
dequantization (``blocks.py``: bit for bit gguf-py's), and GGUF -> Hugging Face tensor names (``names.py``)."""
