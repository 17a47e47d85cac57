"""Distributed conversion: the same output as :mod:`asyncflat.writer.convert`, from tasks on a cluster.

The passes are plain functions over picklable jobs (:mod:`.plan`, :mod:`.pieces`,
:mod:`.layout`, :mod:`.write`); a task runner (:mod:`.runners`) only runs them. Ray is imported
only when the Ray runner is used (``pip install 'asyncflat[distributed]'``). The output is
committed by :mod:`asyncflat.writer.output`, the single-machine writer's protocol.

May import: ``writer``, ``text``, ``format``, ``storage``, ``config``, ``errors`` and ``_typecheck``:
what :mod:`asyncflat.writer` may, and the rest of it.
"""

from asyncflat.writer.distributed.driver import DistributedReport, convert_distributed
from asyncflat.writer.distributed.runners import InProcessRunner, RayRunner, TaskRunner

__all__ = [
    "DistributedReport",
    "InProcessRunner",
    "RayRunner",
    "TaskRunner",
    "convert_distributed",
]
