"""The pure routing core: hashing, prefix index, load model, policies.

Nothing under ``router.core`` does I/O or reads a clock: time (``now``) and randomness
(``rng``) are arguments. The simulator and the service import the same code.
"""
