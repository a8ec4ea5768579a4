"""`dcpctl bench`: a fixed workload over the HTTP API of each plan or endpoint, plus an in-process HF reference.

workload (prompts) -> client (timestamps per request) -> metrics (tok/s, TTFT, TPOT, ITL) -> report (table, files);
roofline puts the measured decode step next to the time to read the weights and the KV once.
"""
