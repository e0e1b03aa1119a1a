"""Speculative decoding, the scheduler's half: who speculates, the proposals (n-gram), and the counts of what
was accepted. The executors verify (executor_svc/speculative_verify.py)."""
