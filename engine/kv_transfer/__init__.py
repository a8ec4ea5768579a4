"""The prefill -> decode KV hand-off: which bytes a decode rank reads (planner), the NIXL transport, the per-rank
exporter (prefill) and receiver (decode), and the handles that cross the network (plain data, validated)."""
