"""Plans: the YAML schema, loading with `base:` and overrides, the cross-checks, and what a KV budget buys (no
torch)."""
