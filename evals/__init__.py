"""Measuring plans and endpoints, as a library (dcpctl's eval, bench and demo commands draw it).

Targets (targets) are plans or URLs; each lives through lifecycle: a plan's server launched through the engine's
entry point (launch), healthy, measured, stopped, a crash blamed on the server; endpoint talks to a server and
watches its engine stats. lm-eval on each target (evaluate, with resume; tasks, lm_eval_runner) gives EvalRuns
(results) with each question's token trace (traces) compared against the baseline (compare), every differing
generation classified as a tie flip or an unexplained divergence (divergence), into a table and files (report);
runlog keeps the libraries' own output in the run's log; bench/ is the throughput and latency run. See NOTES.md for
lm-eval facts.
"""
