"""The flat-tokens format: the token codec and the opening and validation of one split.

* :mod:`.codec`: ``2*id + 1`` at a sequence start, else ``2*id``; encode and decode (pure numpy).
* :mod:`.split`: a split's arrays opened through zarr and checked against the format.

May import: ``errors``; a store is any zarr ``Store`` (the guarded one is passed in), never
:mod:`asyncflat.storage`.
"""

from asyncflat.format.codec import SPLITS, TOKEN_ID_LIMIT, decode, encode_sequences

__all__ = ["SPLITS", "TOKEN_ID_LIMIT", "decode", "encode_sequences"]
