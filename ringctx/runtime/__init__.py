"""What every rank runs: the commands of a job and the state they act on.

The commands (`commands.py`) over a rank's `RankState` (`rank_state.py`), the chunked context-parallel
prefill (`prefill.py`) and its hand-off to the decode ranks (`handoff.py`), decoding over a split
cache (one sequence: `decode.py`; many in one step: `batch.py`) with the shared-memory exchange
between the decode ranks of a CPU host (`shm_exchange.py`), documents (`document.py`) and their
files (`documents.py`), failures (`failures.py`), the memory check before a prefill
(`memory_check.py`) and a run measured against this machine's peaks (`efficiency.py`).

Rank 0's API over these (`Engine`, its handles, the worker processes, start-up, the scheduler) is
ringctx.engine, one layer up; nothing here imports it.
"""
