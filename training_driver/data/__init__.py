"""Training data: the embedded corpus (``corpus``), its BPE tokenizer (``tokenizer``), the
indexed dataset it is preprocessed into (``preprocess``) and the samples a run reads by
iteration (``samples``).
"""
