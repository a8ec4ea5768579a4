"""`dcpctl plan suggest`: every layout the plan checks accept for a model on a cluster, with its capacity and cost.

- `models`: the model to plan for (a checkpoint folder, an alias, a bare config.json, or shipped config facts).
- `hardware`: device figures (vendors' data sheets; `cpu` measured on this machine: `measure`, and the engine's own
  decode work at the model's shapes, `decode_timing`).
- `candidates`: the grid of layouts, each checked by `engine.plan.checks.check_plan` (accepted or rejected with the
  check's own message).
- `figures`: per layout, capacity from `engine.plan.kv_sizing`, weights and collectives from `engine.placement`,
  and a roofline decode step time.
- `suggest`: the request, the ranking under an objective, and the plan YAML a suggestion writes.
"""
