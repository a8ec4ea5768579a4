"""`dcpctl bench`: a fixed workload over the HTTP API of each plan or endpoint, plus an in-process HF reference.

options (what is run, checked before any launch) -> workload (prompts) -> runner (each target through
evals.lifecycle: client timestamps per request, engine stats) -> metrics (tok/s, TTFT, TPOT, ITL) -> report (table,
files); roofline puts the measured decode step next to the time to read the weights and the KV once.
"""
