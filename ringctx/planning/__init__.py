"""Offline modelling that talks to no rank: the paper's strategy rules and the cost model,
memory, prefill and decode plans, mesh proposals, hardware profiles, calibration and the
empirical fit, measured machine speeds (`dtype="auto"`).

    strategy.py       pass-KV / pass-Q: the paper's rules (Alg. 1, Alg. 5, empirical) and the cost model
    memory.py         one rank's memory: weights, KV shard, one layer's working set; the plans' input checks
    prefill_plan.py   plan_prefill (a chunked prefill, chunk by chunk), default_chunk_tokens
    decode_plan.py    plan_decode (the KV cache split over the decode ranks of one host)
    mesh_proposal.py  propose_mesh: (cp, tp) for a number of hosts
    hardware.py       hardware profiles (built-in ones in ringctx/hardware/*.json)
    calibrate.py      measuring a profile on this machine (its jobs run on local ranks)
    empirical.py      fitting the empirical rule's coefficients to measured pass-KV / pass-Q times
    machine_speed.py  read bandwidth and the measured dtype="auto" choice

Planning sits above `model/` and `parallel/` (it reads model shapes and, in calibration, runs
measurement jobs on ranks) and below `engine/`, which asks it for strategies and memory numbers.
"""
