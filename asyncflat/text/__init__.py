"""Text in, token ids out: what the converters read and how they tokenize it.

* :mod:`.corpus`: which files an input names, and the documents in each, in order.
* :mod:`.tokenizer`: tokenizers loaded from a spec string, never downloaded.
* :mod:`.pool`: tokenization in worker processes, in order, that die with their parent.

Part of the write path.

May import: ``format``, ``config`` and ``errors``.
"""
