"""Framework integrations: each framework's keys and layout mapped onto cloudckpt.

One module per framework (``areal``, ``roll``, ``rlinf``); nothing is
re-implemented there, only translated.
"""
