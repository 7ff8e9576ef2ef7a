"""Test and demo machinery that ships with splitserve but that the engine never imports: the tiny
random model (``tiny.py``), built on demand when ``--model tiny`` is asked for
(``splitserve.models.resolve``) or by ``splitserve tiny-model``."""
