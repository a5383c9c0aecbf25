"""Offline modelling that talks to no rank: the paper's strategy rules and the cost model,
memory, prefill and decode plans, mesh proposals, hardware profiles, calibration and the
empirical fit, measured machine speeds (`dtype="auto"`).

Planning sits above `model/` and `parallel/` (it reads model shapes and, in calibration, runs
measurement jobs on ranks) and below `engine/`, which asks it for strategies and memory numbers.
"""
