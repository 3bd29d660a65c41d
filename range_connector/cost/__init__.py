"""The cost model: when loading ``h`` tokens (``T0 + h·s/B``) beats recomputing them (``h/R``), its online estimators
of ``R``, ``B`` and ``T0``, the gate that takes, shortens or refuses a hit, and the calibration file that seeds it.

Pure computation (no I/O but the calibration file). May import: ``errors``, ``kv``.
"""
