"""Distributed conversion: the same output as :mod:`asyncflat.writer.convert`, from tasks on a cluster.

The passes are plain functions over picklable jobs (:mod:`.plan`, :mod:`.pieces`,
:mod:`.layout`, :mod:`.write`); an engine (:mod:`.engines`) only runs them. Ray is imported only
when the Ray engine is used (``pip install 'asyncflat[distributed]'``).

May import: ``writer``, ``text``, ``format``, ``storage``, ``config``, ``errors`` and ``_typecheck``:
what :mod:`asyncflat.writer` may, and the rest of it.
"""

from asyncflat.writer.distributed.driver import DistributedReport, convert_distributed
from asyncflat.writer.distributed.engines import Engine, InProcessEngine, RayEngine

__all__ = ["DistributedReport", "Engine", "InProcessEngine", "RayEngine", "convert_distributed"]
