"""What every loader is built from: the one lifecycle, its iterator, and the jax glue.

* :mod:`.lifecycle`: :class:`~asyncflat.loader.shared.lifecycle.Lifecycle`, the loop thread,
  ``load``/``iter``, load-ahead, device prefetch, statistics and ``close`` of any loader.
* :mod:`.serving`: the :class:`~asyncflat.loader.shared.serving.RowServer` protocol a loader
  supplies (which rows make a step), and the pin on the buffers an iterator reads next.
* :mod:`.iterator`: the iterator of ``(step, batch)`` every loader returns.
* :mod:`.load_ahead` and :mod:`.background`: batches built ahead of the trainer on a thread.
* :mod:`.batch`: the batch type, host-side decoding, sharding and ``jax.Array`` building.
* :mod:`.open`: a split's source, plan and engine, opened on the loop that then owns them.

The plain loader (:mod:`asyncflat.loader.shuffling`) and the mixture
(:mod:`asyncflat.loader.mixture`) both stand on this folder, which knows neither of them.

May import: ``engine``, ``engine.loop``, ``source``, ``source.protocol``, ``source.local_source``,
``source.zarr_source``, ``storage.local_files``, ``plan``, ``format``, ``config`` and ``errors``.
"""
