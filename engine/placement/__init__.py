"""Where a plan's dense layers live, what each rank computes and holds, and which collectives it runs (no torch).

The one owner of these facts (DESIGN.md "Dense placement with replica ranks (Helix)"): the engine's layers take
their slices from `split.RankPlacement`; `plan show`, `plan validate`, the bench roofline and `plan suggest` report
the weights per rank (`weights`) and the collectives per layer (`collectives`) from here.

`parallel.dense` places the dense layers when a layout has replica ranks (dcp > R):
- replicated: each replica of the TP group holds the TP group's slices; only attention is split over DCP.
- sharded (Helix; TensorRT-LLM's `cp_config.cp_type: HELIX`): each rank projects the queries of every head its
  DCP group serves (so queries are never gathered), attends them to its KV shard, and the combine hands it one
  slice of the attention output; o_proj, the MLP / MoE experts, the embedding and the LM head are split over all
  N = tp * dcp / R ranks and summed over the world. Only the q/k/v projections repeat across a DCP group.
Without replica ranks the two are the same: the world is the TP group.
"""
