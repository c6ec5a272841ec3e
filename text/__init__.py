"""Text in and out without transformers: the tokenizer a saved HF fast tokenizer becomes (``tokenizer.py``), chat
templates rendered as transformers renders them (``chat_template.py``), incremental detokenizing for streams
(``detokenizer.py``). No torch."""
