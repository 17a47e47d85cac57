"""The write path: flat-tokens datasets written crash-safely, and the converters that make them.

* :mod:`.flat_tokens`: :class:`~asyncflat.writer.flat_tokens.FlatTokensWriter` and
  :func:`~asyncflat.writer.flat_tokens.write_flat_tokens`, ragged sequences in, a store out.
* :mod:`.output`: the one commit protocol: where a dataset is staged, how it replaces what was
  there (only ever another flat-tokens dataset), and what a crash leaves.
* :mod:`.convert`: text corpora to flat-tokens on one machine; :mod:`.options` holds the
  converters' one options object.
* :mod:`.distributed`: the same conversion as tasks on a cluster (Ray), committed by the same
  protocol.

May import: ``text``, ``format``, ``storage``, ``config``, ``errors`` and ``_typecheck``; never the
read path (:mod:`asyncflat.loader`, :mod:`asyncflat.engine`, :mod:`asyncflat.source`).
"""
