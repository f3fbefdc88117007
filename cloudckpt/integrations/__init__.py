"""Framework integrations: each framework's keys and layout mapped onto cloudckpt.

One package per framework (``areal``, ``roll``, ``rlinf``); nothing is
re-implemented there, only translated. Each declares what the core must know of
it in its ``plugin`` module (:class:`cloudckpt.core.plugins.Framework`), named in
the ``cloudckpt.frameworks`` entry-point group.
"""
