"""The reader: exactly what the engine reads from a flat-tokens split, and nothing more.

* :mod:`.protocol`: :class:`~asyncflat.source.protocol.TokenSource`, the one interface the engine
  uses (sizes, and four reads), and the ``StoreWrapper`` hook.
* :mod:`.zarr_source`: the reader of any split zarr opens (local, fsspec, obstore).
* :mod:`.local_source`: the reader of a plain local split, opened without zarr (fast restarts).
* :mod:`.chunk_reader`: what both readers share: chunk objects decoded straight into the
  engine's buffers (direct Blosc, raw, or zarr's codecs), their layouts and caches.

May import: ``storage``, ``format``, ``config`` and ``errors``.
"""
