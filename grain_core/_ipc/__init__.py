"""The transport under parallel execution: shared-memory blocks (``shm``), worker processes
and their pipes (``pool``), and exceptions across the process boundary (``errors``).

It knows no dataset: it imports nothing of grain_core but itself and ``grain_core.config``,
and carries whatever its callers send. The engines that use it are in
``grain_core.dataset.mp``.
"""
